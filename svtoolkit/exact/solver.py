"""IncrementalSVDD (work in progress in this session)."""


class IncrementalSVDD:  # placeholder until the solver lands in this session
    def __init__(self, C, sigma):
        raise NotImplementedError("IncrementalSVDD is being written")
