"""Input checks shared by the public entry points (NumPy, torch and MLX alike).

Every check raises a specific exception that names the argument and the problem, before any
state is touched (``ValueError`` for values and shapes, ``TypeError`` for the wrong type). The
scalar checks declare their constraint in the call, in the manner of scikit-learn's
``check_scalar``: ``check_int(chunk, "chunk", min=1)``, ``check_real(tol, "tol", min=0.0,
max=0.5, include_max=False)``, ``check_option(backend, "backend", ("auto", "torch"))``. The same
bad value gives the same exception and message wherever it is passed.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["as_keys", "as_key", "check_bool", "check_int", "check_real", "check_option",
           "check_positive", "check_sigma", "largest_violation"]


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


def check_int(value, name, *, min=None, max=None):
    """An integer (Python or NumPy; bool refused) in ``[min, max]``, returned as ``int``.

    Raises
    ------
    TypeError
        ``"{name} must be an int; got {type}"``.
    ValueError
        ``"{name} must be >= {min}; got {value}"`` (or ``<= {max}``, or ``in [{min}, {max}]``
        when both bounds are given).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise ValueError(f"{name} must be {_interval_text(min, max, True, True)}; got {value}")
    return value


def check_bool(value, name):
    """A bool (Python or NumPy), returned as ``bool``; ``TypeError`` otherwise (no truthiness:
    ``0``, ``1`` or ``"yes"`` are refused).

    Raises
    ------
    TypeError
        ``"{name} must be a bool; got {type}"``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def _interval_text(min, max, include_min, include_max):
    if min is not None and max is not None:
        return f"in {'[' if include_min else '('}{min}, {max}{']' if include_max else ')'}"
    if min is not None:
        return f"{'>=' if include_min else '>'} {min}"
    if max is not None:
        return f"{'<=' if include_max else '<'} {max}"
    return ""


def check_real(value, name, *, min=None, max=None, include_min=True, include_max=True):
    """A finite real number (bool refused) in the given interval, returned as ``float``.

    Parameters
    ----------
    value : object
    name : str
        The argument's name, used in the messages.
    min, max : float, optional
        Bounds of the interval (none: unbounded on that side).
    include_min, include_max : bool, default True
        Whether each bound belongs to the interval.

    Raises
    ------
    TypeError
        ``"{name} must be a real number; got {type}"``.
    ValueError
        ``"{name} must be finite and {interval}; got {value}"``, e.g. ``"C must be finite and
        > 0; got -1.0"`` or ``"tol must be finite and in [0.0, 0.5); got 0.5"``.
    """
    if type(value) is not float:  # the common case skips the abstract-class checks
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
        value = float(value)
    below = min is not None and (value < min or (value == min and not include_min))
    above = max is not None and (value > max or (value == max and not include_max))
    if not math.isfinite(value) or below or above:
        interval = _interval_text(min, max, include_min, include_max)
        raise ValueError(f"{name} must be finite{' and ' + interval if interval else ''}; "
                         f"got {value}")
    return value


def check_option(value, name, options):
    """``value`` if it is one of ``options`` (compared with ``==``), else ``ValueError``."""
    if not any(value == option and type(value) is type(option) for option in options):
        listed = ", ".join(repr(o) for o in options)
        raise ValueError(f"{name} must be one of {listed}; got {value!r}")
    return value


def check_positive(value, name):
    """A finite real number ``> 0`` as float: ``check_real(value, name, min=0,
    include_min=False)``."""
    return check_real(value, name, min=0, include_min=False)


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
