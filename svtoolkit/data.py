"""Data shared by the tests, the verification suite, the benchmarks and the examples.

Synthetic key generators (:func:`gaussian_keys`, :func:`redundant_keys`), small preprocessing
helpers (:func:`sliding_windows`, :func:`standardize`, :func:`deduplicate`) and loaders for real
measurements that ship inside PyPI packages, so that nothing is downloaded at run time:

* :func:`load_shuttle` - the Statlog (Shuttle) NASA sensor readings shipped with ``river``
  (the file behind ``river.datasets.Shuttle``; 49,097 rows x 9 sensors, 7.15 % anomalies).
* :func:`load_mitdb_ecg` - the MIT-BIH ECG excerpt shipped with ``sktime`` (7,500 samples, one
  labelled anomalous segment).

The loaders locate the package with :func:`importlib.util.find_spec` and read its data file
directly; they never import the package (``import river.datasets`` alone takes seconds).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
from pathlib import Path

import numpy as np

from ._validation import as_keys, check_int, check_positive

__all__ = [
    "gaussian_keys",
    "redundant_keys",
    "sliding_windows",
    "standardize",
    "deduplicate",
    "load_shuttle",
    "load_mitdb_ecg",
    "SHUTTLE_FEATURES",
]

#: Column names of the Shuttle sensors, as in ``river.datasets.Shuttle``.
SHUTTLE_FEATURES = tuple(f"f{i}" for i in range(1, 10))


def _check_count(value, name, minimum=1):
    return check_int(value, name, min=minimum)


def _as_rng(rng):
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


# ------------------------------------------------------------------------------ synthetic keys
def gaussian_keys(n, d, *, scale=1.0, rng=None):
    """Keys drawn i.i.d. from ``scale * N(0, I_d)``.

    Parameters
    ----------
    n, d : int
        Number of keys and their dimension.
    scale : float, default 1.0
        Standard deviation of every coordinate.
    rng : numpy.random.Generator or int or None
        Source of randomness (an int is used as the seed of ``default_rng``).

    Returns
    -------
    ndarray of shape (n, d), float64

    Examples
    --------
    >>> from svtoolkit.data import gaussian_keys
    >>> gaussian_keys(24, 6, rng=0).shape
    (24, 6)
    """
    n = _check_count(n, "n")
    d = _check_count(d, "d")
    scale = check_positive(scale, "scale")
    return scale * _as_rng(rng).standard_normal((n, d))


def redundant_keys(n_clusters, per_cluster, d, *, spread=1.0, jitter=0.03, rng=None):
    """Clusters of near-duplicate keys.

    The cluster centres are drawn from ``spread * N(0, I_d)``; each cluster holds
    ``per_cluster`` copies of its centre, each moved by ``jitter * N(0, I_d)``. Rows are
    grouped by cluster (the first ``per_cluster`` rows belong to cluster 0, and so on).

    Parameters
    ----------
    n_clusters, per_cluster, d : int
        Number of clusters, keys per cluster and key dimension.
    spread : float, default 1.0
        Standard deviation of the cluster centres.
    jitter : float, default 0.03
        Standard deviation of each member around its centre. ``0`` gives exact duplicates.
    rng : numpy.random.Generator or int or None

    Returns
    -------
    ndarray of shape (n_clusters * per_cluster, d), float64

    Notes
    -----
    With ``d = 6`` and the RBF width 2 of the verification suite, 4 clusters of 6 keys at
    ``jitter = 0.03`` give a median Gram condition number of about 4e5 (the paper's redundant
    regime reports 2e5 to 3e5).
    """
    n_clusters = _check_count(n_clusters, "n_clusters")
    per_cluster = _check_count(per_cluster, "per_cluster")
    d = _check_count(d, "d")
    spread = check_positive(spread, "spread")
    if not np.isfinite(jitter) or jitter < 0:
        raise ValueError(f"jitter must be finite and >= 0; got {jitter}")
    rng = _as_rng(rng)
    centres = spread * rng.standard_normal((n_clusters, d))
    noise = float(jitter) * rng.standard_normal((n_clusters * per_cluster, d))
    return np.repeat(centres, per_cluster, axis=0) + noise


# ------------------------------------------------------------------------------ preprocessing
def sliding_windows(X, width, step=1):
    """Contiguous windows of a series.

    Parameters
    ----------
    X : array_like of shape (T,) or (T, d)
        A univariate or multichannel series, time along the first axis.
    width : int
        Window length (number of time steps).
    step : int, default 1
        Offset between the starts of consecutive windows.

    Returns
    -------
    ndarray of shape (n_windows, width) or (n_windows, width, d)
        A copy; ``n_windows = (T - width) // step + 1``. For a univariate series each row is a
        delay-embedding key; for a multichannel one each window is a context of ``width``
        keys.

    Raises
    ------
    ValueError
        ``X`` is not 1-D or 2-D, or shorter than ``width``.

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit.data import sliding_windows
    >>> sliding_windows(np.arange(5.0), 3, step=2)
    array([[0., 1., 2.],
           [2., 3., 4.]])
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim not in (1, 2):
        raise ValueError(f"X must be 1-D (T,) or 2-D (T, d); got shape {X.shape}")
    width = _check_count(width, "width")
    step = _check_count(step, "step")
    if X.shape[0] < width:
        raise ValueError(f"X has {X.shape[0]} time steps, fewer than width={width}")
    starts = np.arange(0, X.shape[0] - width + 1, step)
    index = starts[:, None] + np.arange(width)[None, :]
    return X[index].copy()


def standardize(X, *, mean=None, std=None):
    """Column-wise z-scores ``(X - mean) / std``.

    Parameters
    ----------
    X : array_like of shape (n, d)
    mean, std : array_like of shape (d,), optional
        Statistics to use (e.g. those of a whole data set when standardizing one window).
        Computed from ``X`` when omitted.

    Returns
    -------
    ndarray of shape (n, d)

    Raises
    ------
    ValueError
        A column has zero (or non-finite) standard deviation.
    """
    X = as_keys(X, "X")
    mean = X.mean(axis=0) if mean is None else np.asarray(mean, dtype=np.float64)
    std = X.std(axis=0) if std is None else np.asarray(std, dtype=np.float64)
    if mean.shape != (X.shape[1],) or std.shape != (X.shape[1],):
        raise ValueError(f"mean and std must have shape ({X.shape[1]},)")
    bad = ~np.isfinite(std) | (std <= 0)
    if bad.any():
        raise ValueError(f"std must be finite and > 0; columns {np.flatnonzero(bad).tolist()} "
                         "are constant or invalid")
    return (X - mean) / std


def deduplicate(X, radius):
    """Drop keys within ``radius`` of an earlier kept key (greedy, in row order).

    A row is kept when its Euclidean distance to every row kept before it exceeds
    ``radius``; so every pair of kept rows is more than ``radius`` apart, and every dropped
    row lies within ``radius`` of a kept one.

    Parameters
    ----------
    X : array_like of shape (n, d)
    radius : float
        ``>= 0``; ``0`` drops exact duplicates only.

    Returns
    -------
    kept : ndarray of shape (m, d)
        The kept rows, in their original order.
    index : ndarray of shape (m,), int64
        Their row numbers in ``X``.

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit.data import deduplicate
    >>> deduplicate(np.array([[0.0], [0.05], [1.0]]), 0.1)[1]
    array([0, 2])
    """
    X = as_keys(X, "X")
    if not np.isfinite(radius) or radius < 0:
        raise ValueError(f"radius must be finite and >= 0; got {radius}")
    kept = []
    for i in range(X.shape[0]):
        if kept:
            dist = np.sqrt(((X[kept] - X[i]) ** 2).sum(axis=1))
            if dist.min() <= radius:
                continue
        kept.append(i)
    index = np.array(kept, dtype=np.int64)
    return X[index].copy(), index


# ------------------------------------------------------------------------------ real data
def _package_file(package, relative, extra):
    """Path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"this data set ships inside the '{package}' package, which is not installed: "
            f"pip install 'svtoolkit[{extra}]'"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the installed '{package}' has no {relative}; this version may not ship the data"
    )


def _read_csv(raw, expected_header):
    text = io.StringIO(raw.decode("utf-8"))
    header = text.readline().strip().split(",")
    if header != list(expected_header):
        raise ValueError(f"unexpected header {header}; expected {list(expected_header)}")
    return np.loadtxt(text, delimiter=",", dtype=np.float64, ndmin=2)


def load_shuttle(*, return_labels=False):
    """The Statlog (Shuttle) sensor readings shipped inside ``river``.

    The file is the one behind ``river.datasets.Shuttle`` (UCI Statlog Shuttle in the ODDS
    anomaly-detection form: the majority "Rad Flow" class is normal, the rare classes are
    anomalies, the second-largest class is removed). Rows are in the file's order.

    Parameters
    ----------
    return_labels : bool, default False
        Also return the anomaly labels.

    Returns
    -------
    X : ndarray of shape (49097, 9), float64
        Sensor readings ``f1 .. f9`` (integers in the file).
    y : ndarray of shape (49097,), int8
        1 for an anomaly, 0 otherwise (only with ``return_labels=True``).

    Raises
    ------
    ImportError
        ``river`` is not installed (it is in the ``verify`` extra).

    Notes
    -----
    Licence: river is BSD-3; the data set is UCI CC-BY-4.0.
    """
    path = _package_file("river", "datasets/shuttle.csv.gz", "verify")
    table = _read_csv(gzip.decompress(path.read_bytes()), SHUTTLE_FEATURES + ("anomaly",))
    X = np.ascontiguousarray(table[:, :-1])
    if return_labels:
        return X, table[:, -1].astype(np.int8)
    return X


def load_mitdb_ecg():
    """The MIT-BIH ECG excerpt shipped inside ``sktime`` (read without importing sktime).

    Returns
    -------
    signal : ndarray of shape (7500,), float64
        ECG amplitude.
    labels : ndarray of shape (7500,), int8
        1 inside the labelled anomalous segment, else 0.

    Raises
    ------
    ImportError
        ``sktime`` is not installed: ``pip install 'svtoolkit[examples]'``.
    FileNotFoundError
        The installed sktime does not ship ``datasets/data/mitdb/mitdb.csv`` (sktime 1.2.0
        does; the file has no loader or documentation upstream and could disappear).

    Notes
    -----
    Licence: sktime is BSD-3; MIT-BIH Arrhythmia Database, ODC-By.
    """
    path = _package_file("sktime", "datasets/data/mitdb/mitdb.csv", "examples")
    table = _read_csv(path.read_bytes(), ("data", "label"))
    return np.ascontiguousarray(table[:, 0]), table[:, 1].astype(np.int8)
