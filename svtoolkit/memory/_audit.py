"""The rolling audit: the solver's maintained quantities checked fresh, a slice per operation.

The exact walk maintains the gradients of every key and the inverse of the bordered margin
system; later deletions build on them. :meth:`IncrementalSVDD.audit` compares all of them with
a fresh evaluation from the keys at once (O(n |support| d + m^3)), which at 10^5 records is
seconds for one operation. A memory runs the same comparison in slices instead: after every
operation that changed the solver it recomputes the gradients of the next
``max(MIN_KEYS, ceil(n / AUDIT_PERIOD))`` keys in solver-id order (a cursor that wraps) and
multiplies the next ``max(MIN_COLUMNS, ceil((m + 1) / AUDIT_PERIOD))`` columns of the bordered
system by the maintained inverse. A slice whose drift exceeds the solver's own audit
thresholds triggers the full audit, which refactorises (the repair a periodic audit would
make). Solver ids never move, so a key held for ``AUDIT_PERIOD`` operations has had its
maintained gradient compared with a fresh one at least once in them.
"""

from __future__ import annotations

import numpy as np

from ..exact.solver import AUDIT_GRAD_TOL, AUDIT_INVERSE_TOL

__all__ = ["AUDIT_PERIOD", "RollingAudit"]

#: Every maintained gradient (and inverse column) is compared with a fresh evaluation at least
#: once per this many solver-changing operations - the period of the solver's own audit.
AUDIT_PERIOD = 1000
#: Fewest keys (bordered-system columns) one slice checks, so small memories cycle within a
#: few hundred operations (a slice's cost is then still a few kernel rows).
MIN_KEYS = 8
MIN_COLUMNS = 4


def _largest(values):
    """max |values| (0.0 when empty, inf when any is NaN)."""
    if values.size == 0:
        return 0.0
    top = float(np.max(np.abs(values)))
    return top if top == top else float("inf")


class RollingAudit:
    """Cursor of the rolling audit (next solver id, next bordered-system column).

    Parameters
    ----------
    next_id, next_column : int, default 0
        Where the next slice starts (restored from a memory file).
    """

    def __init__(self, next_id=0, next_column=0):
        self.next_id = int(next_id)
        self.next_column = int(next_column)

    def cursor(self):
        """``[next_id, next_column]`` (saved with the memory)."""
        return [self.next_id, self.next_column]

    def step(self, solver, repair=True):
        """Check one slice of ``solver``'s maintained state; run the full audit on drift.

        Parameters
        ----------
        solver : IncrementalSVDD
        repair : bool, default True
            Run the full audit (which refactorises) when the slice drifted past the solver's
            audit thresholds; False only measures (a loader refuses instead).

        Returns
        -------
        dict
            ``gradients_checked``, ``grad_drift``, ``inverse_columns_checked``,
            ``inverse_residual``, ``repaired`` (see :class:`DeletionReceipt`).
        """
        keys, drift = self._gradients(solver)
        columns, inverse = self._inverse(solver)
        repaired = repair and not (drift <= AUDIT_GRAD_TOL and inverse <= AUDIT_INVERSE_TOL)
        if repaired:
            solver.audit()  # refactorises: the repair the solver's periodic audit makes
        return {"gradients_checked": keys, "grad_drift": drift,
                "inverse_columns_checked": columns, "inverse_residual": inverse,
                "repaired": repaired}

    def _gradients(self, solver):
        """Fresh gradients of the next keys in id order against the maintained ones."""
        ids = solver.ids
        n = ids.shape[0]
        if n == 0:
            return 0, 0.0
        k = min(n, max(MIN_KEYS, -(-n // AUDIT_PERIOD)))
        start = int(np.searchsorted(ids, self.next_id))
        chosen = ids[(start + np.arange(k)) % n]
        self.next_id = int(ids[(start + k) % n]) if k < n else int(chosen[0])
        slots = np.fromiter((solver._slot_of[int(i)] for i in chosen), dtype=np.int64,
                            count=k)
        # at a key the decision function is its gradient g = 2 sum_j a_j k(x, x_j) - 1 + rho
        fresh = solver.decision_function(solver._Xt[:, slots].T)
        return k, _largest(solver._grad[slots] - fresh)

    def _inverse(self, solver):
        """Columns of R M - I for the maintained inverse R and the bordered system M."""
        m = solver._m
        if m == 0:
            return 0, 0.0
        size = m + 1
        k = min(size, max(MIN_COLUMNS, -(-size // AUDIT_PERIOD)))
        cols = (self.next_column + np.arange(k)) % size
        self.next_column = int((self.next_column + k) % size)
        S = solver._S[:m]
        block = np.empty((size, k))
        for j, c in enumerate(cols):
            if c == 0:
                block[0, j] = 0.0
                block[1:, j] = 1.0
            else:
                block[0, j] = 1.0
                block[1:, j] = 2.0 * solver._KSt[:m, S[c - 1]]
        product = solver._R[:size, :size] @ block
        product[cols, np.arange(k)] -= 1.0
        return k, _largest(product)
