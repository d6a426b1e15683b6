"""Input checks shared by the public entry points.

Every check raises a specific exception that names the argument and the problem, before any
state is touched (``ValueError`` for values and shapes, ``TypeError`` for non-numeric data).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["as_keys", "as_key", "check_positive", "check_sigma", "largest_violation"]


def _as_float_array(x, name):
    if isinstance(x, np.ndarray) and x.dtype.kind in "fiub":
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except Exception as exc:  # pragma: no cover - exotic containers
            raise TypeError(f"{name} must be numeric array-like; got {type(x).__name__}") from exc
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"{name} must be numeric; got dtype {arr.dtype}")
    return np.array(arr, dtype=np.float64, order="C", copy=True)


def _check_finite(arr, name):
    if not np.isfinite(arr).all():
        bad = "NaN" if np.isnan(arr).any() else "inf"
        raise ValueError(f"{name} contains {bad}; keys must be finite")


def as_keys(X, name="X", d=None):
    """Coerce to a finite float64 C-contiguous copy of shape (n, d)."""
    arr = _as_float_array(X, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D of shape (n, d); got shape {arr.shape}")
    if arr.shape[1] == 0:
        raise ValueError(f"{name} must have at least one feature; got shape {arr.shape}")
    if d is not None and arr.shape[1] != d:
        raise ValueError(f"{name} has dimension {arr.shape[1]}, expected {d}")
    _check_finite(arr, name)
    return arr


def as_key(x, name="x", d=None):
    """Coerce one key to a finite float64 vector of shape (d,)."""
    arr = _as_float_array(x, name)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D of shape (d,); got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} must have at least one feature")
    if d is not None and arr.shape[0] != d:
        raise ValueError(f"{name} has dimension {arr.shape[0]}, expected {d}")
    _check_finite(arr, name)
    return arr


def check_positive(value, name):
    """A finite real number ``> 0`` as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0; got {value}")
    return value


def check_sigma(sigma):
    """Kernel width: finite, ``> 0``, and with ``sigma**2`` and ``1 / sigma**2`` both finite
    normal numbers (the kernel is evaluated as ``exp(-|x - y|^2 / sigma^2)``)."""
    sigma = check_positive(sigma, "sigma")
    square = sigma * sigma
    tiny = np.finfo(np.float64).tiny
    if not (tiny <= square < math.inf and tiny <= 1.0 / square < math.inf):
        raise ValueError(f"sigma={sigma!r} is out of range: sigma**2 and 1/sigma**2 must be "
                         "finite normal floats (about 1.5e-154 < sigma < 6.7e153)")
    return sigma


def largest_violation(terms):
    """The largest of a list of KKT violation terms; ``inf`` when any term is NaN.

    Python's ``max`` silently drops a NaN that does not come first, which would make a broken
    state look optimal; a NaN anywhere means the state is not a solution at all.
    """
    values = np.asarray(terms, dtype=np.float64)
    if np.isnan(values).any():
        return math.inf
    return float(values.max())
