"""Old import path of :mod:`svtoolkit.torch.ops.chunked_sv` (the chunked SV gate and readouts).

The module was renamed so that no module shares its name with a function
(:func:`svtoolkit.torch.sv_attention` is the set-level readout). Importing this path gives the
renamed module itself, so attributes read or replaced through either name are the same.
"""

import sys

from . import chunked_sv

sys.modules[__name__] = chunked_sv
