r"""The differentiable exact gate: the fp64 SVDD optimum with an inverse-reusing backward.

The entry points. The forward pass is the exact fp64 solver
:class:`svtoolkit.IncrementalSVDD`; the backward pass (:mod:`svtoolkit.torch._gate_autograd`,
where the mathematics is written out) reuses the bordered KKT inverse ``R = M^{-1}`` that the
solver already maintains, so it performs **no linear solve and no factorization** (Forgetful
Attention (arXiv:2607.12204), §3.3 and App. A).

* :func:`svdd_gate` - keys -> (alpha, rho), a fresh exact solve;
* :func:`gate_from_solver` - differentiate an existing solver state (no re-solve);
* :func:`svdd_gate_from_gram` - K -> (alpha, rho) for a given partition;
* :func:`svdd_decision` - the decision function in torch.

The autograd Functions and ``rbf`` are in :mod:`svtoolkit.torch._gate_autograd`, the slow
reference ``bordered_solve_gate`` in :mod:`svtoolkit.torch.ops.naive_gate` and the set-level
readout ``sv_attention`` / ``SVAttention`` in :mod:`svtoolkit.torch.layers.set_readout`.

**Warm-up.** While ``n C < 1`` the problem is infeasible and nothing is certified:
:func:`svdd_gate` and :func:`gate_from_solver` raise.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .._rules import feasible, sums_to_one
from .._validation import check_positive
from ..exact import IncrementalSVDD
from ..kernels import rbf_kernel
from ._checks import as_numpy64, check_keys_shape, check_tensor
from ._gate_autograd import ExactGateFunction, GramGateFunction, _make_state, rbf

__all__ = [
    "svdd_gate",
    "svdd_gate_from_gram",
    "gate_from_solver",
    "svdd_decision",
]

#: K-level forward: a given partition is accepted when its KKT signs hold to this (units of f).
PARTITION_SIGN_TOL = 1e-9


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _positions(idx, name, n):
    """A partition argument as int64 positions in ``[0, n)``.

    Non-integer dtypes are refused rather than cast: float positions would be truncated and a
    bool mask would be read as the positions 0 and 1.
    """
    idx = np.asarray(idx)
    if idx.size and idx.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer positions (np.flatnonzero(mask) for a bool "
                        f"mask); got dtype {idx.dtype}")
    if idx.ndim > 1:
        raise ValueError(f"{name} must be a 1-D sequence of positions; got shape {idx.shape}")
    idx = idx.astype(np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"{name} positions must be in [0, {n}); got {idx.tolist()}")
    return idx


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------


def _fresh_solver(keys64, C, sigma):
    solver = IncrementalSVDD(C, sigma)
    solver.extend(keys64)
    return solver


def _state_from_solver(solver, device):
    system = solver.margin_system()
    ids = solver.ids
    margin = np.searchsorted(ids, system.margin_ids)
    error = np.searchsorted(ids, system.error_ids)
    keys = solver.keys

    def h():
        # h = 2 K a - 1 (only needed with S empty, where a = C on E and 0 elsewhere)
        return 2.0 * solver.C * rbf_kernel(keys, keys[error], sigma=solver.sigma).sum(1) - 1.0

    return _make_state(len(ids), solver.C, solver.alpha, solver.rho, margin, error,
                       system.inverse, h, device)


def gate_from_solver(solver, keys):
    """Differentiate an existing exact solver state with respect to its keys (no re-solve).

    Parameters
    ----------
    solver : IncrementalSVDD
        A certified solver (``n C >= 1``), e.g. a memory that has had deletions.
    keys : Tensor of shape (n, d)
        The solver's keys **in the order of** ``solver.ids`` (``solver.keys``), as a tensor that
        carries the graph to differentiate. Must equal ``solver.keys`` exactly (in float64).

    Returns
    -------
    alpha : Tensor of shape (n,), float64
        Coefficients aligned with ``solver.ids`` (reserve keys exactly 0).
    rho : Tensor of shape (), float64

    Raises
    ------
    RuntimeError
        The solver is in warm-up (``n C < 1``): nothing is certified and the gate is undefined.
    ValueError
        ``keys`` has the wrong shape or differs from the solver's keys.

    Notes
    -----
    The backward is Forgetful Attention (arXiv:2607.12204), App. A, with the solver's
    maintained inverse (``solver.margin_system().inverse``) - see
    :mod:`svtoolkit.torch._gate_autograd`.
    """
    if not isinstance(solver, IncrementalSVDD):
        raise TypeError(f"solver must be an IncrementalSVDD; got {type(solver).__name__}")
    check_tensor(keys, "keys", 2, "(n, d)")
    if not solver.certified:
        raise RuntimeError(
            "the exact gate needs a certified solver: it is in warm-up (n * C < 1, "
            f"n = {len(solver)}, C = {solver.C:.6g}); use the ungated readout until n * C >= 1"
        )
    held = solver.keys
    if tuple(keys.shape) != held.shape:
        raise ValueError(
            f"keys must have the solver's shape {held.shape} (rows in the order of "
            f"solver.ids); got {tuple(keys.shape)}"
        )
    if not np.array_equal(as_numpy64(keys), held):
        raise ValueError("keys differ from solver.keys: the gradient would be of another problem")
    state = _state_from_solver(solver, keys.device)
    return ExactGateFunction.apply(keys, state, solver.sigma)


def svdd_gate(keys, *, C, sigma):
    """The exact SVDD gate ``keys -> (alpha, rho)`` with the inverse-reusing backward.

    Parameters
    ----------
    keys : Tensor of shape (n, d)
    C : float
        Box constraint (fixed); ``n C >= 1`` is required.
    sigma : float
        RBF width, ``k(a, b) = exp(-||a - b||^2 / sigma^2)``.

    Returns
    -------
    alpha : Tensor of shape (n,), float64
        The exact optimum (fp64 solver); reserve keys exactly 0.
    rho : Tensor of shape (), float64
        ``f(x) = 2 sum_i a_i k(x, x_i) - 1 + rho`` (the sign convention of docs/design.md).

    Raises
    ------
    ValueError
        ``n C < 1`` (warm-up: infeasible, nothing certified), no keys or no features, bad
        shapes, NaN or inf.

    Notes
    -----
    Forward: :class:`svtoolkit.IncrementalSVDD` built by ``extend`` in fp64. Backward: App. A
    with the solver's maintained inverse (one product with ``R^T``, rank-one
    assemblies, the kernel chain rule); no solve, no factorization. Partition changes are
    kinks and are not differentiated through.

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import svdd_gate
    >>> keys = torch.randn(20, 3, dtype=torch.float64,
    ...                    generator=torch.Generator().manual_seed(0)).requires_grad_()
    >>> alpha, rho = svdd_gate(keys, C=0.1, sigma=1.5)
    >>> bool(abs(alpha.sum().item() - 1.0) < 1e-12)
    True
    >>> (alpha[:5].sum() + rho).backward()
    >>> keys.grad.shape
    torch.Size([20, 3])
    """
    C = check_positive(C, "C")
    sigma = check_positive(sigma, "sigma")
    check_tensor(keys, "keys", 2, "(n, d)")
    check_keys_shape(keys)
    n = keys.shape[0]
    if not feasible(n, C):
        raise ValueError(
            f"infeasible: n * C = {n * C:.6g} < 1 (warm-up); the exact gate needs n * C >= 1"
        )
    solver = _fresh_solver(as_numpy64(keys), C, sigma)
    return gate_from_solver(solver, keys)


def svdd_gate_from_gram(K, C, *, margin=None, error=None):
    """The K-level gate ``K -> (alpha, rho)`` with the same inverse-reusing backward.

    Parameters
    ----------
    K : Tensor of shape (n, n)
        Kernel matrix (symmetric PSD at the point of interest).
    C : float
    margin, error : array_like of int
        The partition to hold fixed: 1-D integer positions (not bool masks; an empty list is
        fine). Both are required: the exact solver works on keys, not on a Gram matrix, and
        the library never calls the interior-point reference at run time. For the RBF Gram
        of keys X, take them from the exact solver, ``s = IncrementalSVDD(C, sigma);
        s.extend(X); sys = s.margin_system()``, ``margin = np.searchsorted(s.ids,
        sys.margin_ids)`` and likewise ``error`` (or use :func:`svdd_gate` on the keys); for
        any other K, from an offline solve such as :func:`svtoolkit.reference.solve_svdd`.

    Returns
    -------
    alpha : Tensor of shape (n,), float64
    rho : Tensor of shape (), float64

    Raises
    ------
    TypeError
        ``margin`` or ``error`` is not integer (floats, a bool mask).
    ValueError
        ``margin`` or ``error`` missing; the partition is not optimal for ``K`` (a margin
        coefficient outside (0, C) or an error/reserve sign violated beyond
        :data:`PARTITION_SIGN_TOL`), or it does not sum to one when S is empty; positions out
        of range or repeated; bad shapes, NaN or inf.

    Notes
    -----
    The forward solves the bordered system of the given partition (``np.linalg.inv`` once:
    the forward's factorization); the backward uses only that inverse and alpha, exactly as
    :func:`svdd_gate` does with the solver's maintained one. For a non-symmetric K the map is
    the solution of the KKT equations as written (see the module docstring).
    """
    C = check_positive(C, "C")
    check_tensor(K, "K", 2, "(n, n)")
    n = K.shape[0]
    if K.shape[1] != n or n == 0:
        raise ValueError(f"K must be a non-empty square matrix; got shape {tuple(K.shape)}")
    K64 = as_numpy64(K)
    if margin is None or error is None:
        raise ValueError(
            "give both margin and error: the K-level gate differentiates a given partition "
            "(for keys use svdd_gate, or take the partition from IncrementalSVDD.margin_system)"
        )
    margin = _positions(margin, "margin", n)
    error = _positions(error, "error", n)
    member = np.zeros(n, dtype=np.int64)
    for idx in (margin, error):
        np.add.at(member, idx, 1)
    if member.max(initial=0) > 1:
        raise ValueError("margin and error must be disjoint and without repeats")
    alpha = np.zeros(n)
    alpha[error] = C
    m = len(margin)
    diagK = np.diag(K64)
    if m:
        M = np.zeros((m + 1, m + 1))
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * K64[np.ix_(margin, margin)]
        c = np.empty(m + 1)
        c[0] = 1.0 - len(error) * C
        c[1:] = diagK[margin] - 2.0 * C * K64[np.ix_(margin, error)].sum(axis=1)
        inverse = np.linalg.inv(M)  # the forward's one factorization
        u = inverse @ c
        u += inverse @ (c - M @ u)  # one step of iterative refinement
        rho = float(u[0])
        alpha[margin] = u[1:]
    else:
        if not sums_to_one(len(error), C):
            raise ValueError(
                f"with an empty margin set sum(a) = |E| C must be 1; got {len(error) * C:.6g}"
            )
        inverse = np.zeros((1, 1))
        rho = None
    h = 2.0 * (K64 @ alpha) - diagK
    state = _make_state(n, C, alpha, 0.0 if rho is None else rho, margin, error, inverse,
                        lambda: h, K.device)
    if rho is None:
        rows = state.rows.cpu().numpy()
        rho = float(np.sum(state.rho_weights.cpu().numpy() * -h[rows]))
        state = dataclasses.replace(
            state, rho=torch.tensor(rho, dtype=torch.float64, device=K.device))
    _check_partition(alpha, h + rho, margin, error, C)
    return GramGateFunction.apply(K, state)


def _check_partition(alpha, g, margin, error, C):
    n = len(alpha)
    if len(margin) and not ((alpha[margin] > 0.0).all() and (alpha[margin] < C).all()):
        raise ValueError("the partition is not optimal for K: a margin coefficient left (0, C)")
    reserve = np.setdiff1d(np.arange(n), np.concatenate([margin, error]))
    if len(error) and g[error].max() > PARTITION_SIGN_TOL:
        raise ValueError(f"the partition is not optimal for K: g = {g[error].max():.3e} > 0 "
                         "on the error set")
    if len(reserve) and g[reserve].min() < -PARTITION_SIGN_TOL:
        raise ValueError(f"the partition is not optimal for K: g = {g[reserve].min():.3e} < 0 "
                         "on the reserve set")


def svdd_decision(queries, keys, alpha, rho, *, sigma):
    """Decision scores ``f(q) = 2 sum_i a_i k(q, x_i) - 1 + rho`` (f > 0 inside).

    Parameters
    ----------
    queries : Tensor of shape (m, d)
    keys : Tensor of shape (n, d)
    alpha : Tensor of shape (n,)
    rho : Tensor of shape ()

    Returns
    -------
    Tensor of shape (m,)
    """
    return 2.0 * rbf(queries, keys, sigma=sigma) @ alpha - 1.0 + rho
