"""Verification: the exact gate's inverse-reusing backward (Forgetful Attention
(arXiv:2607.12204), App. A).

``run(quick=True) -> list[dict]``, one record per check, each
``{"name", "passed", "value", "tolerance", "op", "detail"}`` (value <= tolerance passes; without
torch a single skipped record, ``passed`` None):

* ``gradient.dense_implicit[n=..]`` - keys gradient of :func:`svtoolkit.torch.svdd_gate`
  (exact solver forward, maintained inverse in the backward) vs autograd through a fresh
  ``torch.linalg.solve`` of the bordered system written here, on the partition found by the
  *independent* QP reference (cvxpy + polish). Value: max relative difference.
* ``gradient.finite_differences[n=..]`` - the same gradient vs central differences (h = 1e-6)
  of the scalarization, on coordinates whose partition is unchanged at +-h (checked).
* ``gradient.after_deletions`` - :func:`svtoolkit.torch.gate_from_solver` on a memory that
  had deletions (no re-solve) vs the dense reference on the retained keys.
* ``gradient.no_factorization_in_backward`` - number of ATen solve/factorization ops seen
  during the backward (must be 0).

Problems: keys ~ N(0, I_6) (seed 31 + n), sigma = median pairwise distance,
C = 1 / (0.4 n); the scalarization is ``<alpha, alpha_bar> + rho rho_bar`` with fixed random
cotangents.
"""

from __future__ import annotations

import numpy as np

#: Inverse-reusing VJP vs the dense implicit-function gradient (relative, max-abs).
DENSE_TOL = 1e-10
#: Inverse-reusing VJP vs central finite differences (relative to max |grad|).
FD_TOL = 1e-6
FD_STEP = 1e-6
SEED, D, NU = 31, 6, 0.4

FACTORIZATION_OPS = ("solve", "inv", "lstsq", "cholesky", "lu", "qr", "svd", "eig", "triangular",
                     "pinv", "ldl")


def _record(name, passed, value, tolerance, detail):
    """The suite's record shape (see verification/records.py); value is compared by <=."""
    return {"name": name, "passed": bool(passed), "value": float(value),
            "tolerance": float(tolerance), "op": "<=", "detail": detail}


def _problem(n):
    from scipy.spatial.distance import pdist

    keys = np.random.default_rng(SEED + n).standard_normal((n, D))
    return keys, 1.0 / (NU * n), float(np.median(pdist(keys)))


def _cotangents(torch, n):
    gen = torch.Generator().manual_seed(SEED + n)
    return (torch.randn(n, generator=gen, dtype=torch.float64),
            torch.randn((), generator=gen, dtype=torch.float64))


def _kernel(torch, x, sigma):
    diff = x[:, None, :] - x[None, :, :]
    return torch.exp(-(diff * diff).sum(-1) / sigma**2)


def _dense_scalar(torch, x, sigma, C, margin, error, alpha_bar, rho_bar):
    """<alpha, alpha_bar> + rho rho_bar by a fresh bordered solve (autograd differentiates)."""
    K = _kernel(torch, x, sigma)
    m, n = len(margin), x.shape[0]
    M = torch.zeros(m + 1, m + 1, dtype=torch.float64)
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[margin][:, margin]
    c = torch.cat([torch.tensor([1.0 - len(error) * C], dtype=torch.float64),
                   1.0 - 2.0 * C * K[margin][:, error].sum(1)])
    u = torch.linalg.solve(M, c)
    alpha = torch.zeros(n, dtype=torch.float64)
    alpha[error] = C
    alpha = alpha.index_put((torch.as_tensor(margin),), u[1:])
    return (alpha * alpha_bar).sum() + u[0] * rho_bar


def _check_dense(torch, n):
    from svtoolkit.reference import solve_svdd
    from svtoolkit.torch import svdd_gate

    keys, C, sigma = _problem(n)
    alpha_bar, rho_bar = _cotangents(torch, n)
    x = torch.tensor(keys, requires_grad=True)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    (grad,) = torch.autograd.grad((alpha * alpha_bar).sum() + rho * rho_bar, x)
    ref = solve_svdd(_kernel(torch, x, sigma).detach().numpy(), C)
    same = (ref.polished and set(ref.margin) == set(np.flatnonzero(
        (alpha.detach().numpy() > 0) & (alpha.detach().numpy() < C))))
    x_ref = torch.tensor(keys, requires_grad=True)
    (grad_ref,) = torch.autograd.grad(
        _dense_scalar(torch, x_ref, sigma, C, ref.margin, ref.error, alpha_bar, rho_bar), x_ref)
    value = float((grad - grad_ref).abs().max() / grad_ref.abs().max())
    return _record(
        f"gradient.dense_implicit[n={n}]", same and value <= DENSE_TOL, value, DENSE_TOL,
        f"|S|={len(ref.margin)}, |E|={len(ref.error)}; partition from the QP reference "
        f"{'agrees' if same else 'DISAGREES'} with the exact solver; max|grad|="
        f"{float(grad_ref.abs().max()):.3e}")


def _check_finite_differences(torch, n, max_coords):
    from svtoolkit.torch import svdd_gate

    keys, C, sigma = _problem(n)
    alpha_bar, rho_bar = _cotangents(torch, n)
    x = torch.tensor(keys, requires_grad=True)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    (grad,) = torch.autograd.grad((alpha * alpha_bar).sum() + rho * rho_bar, x)
    pattern = (alpha.detach() == 0).numpy(), (alpha.detach() == C).numpy()
    coords = [(i, j) for i in range(n) for j in range(D)]
    rng = np.random.default_rng(SEED)
    if len(coords) > max_coords:
        coords = [coords[k] for k in rng.choice(len(coords), max_coords, replace=False)]
    worst, used, skipped = 0.0, 0, 0
    scale = float(grad.abs().max())
    for i, j in coords:
        values = []
        stable = True
        for sign in (1.0, -1.0):
            xp = keys.copy()
            xp[i, j] += sign * FD_STEP
            a, r = svdd_gate(torch.tensor(xp), C=C, sigma=sigma)
            same = (a == 0).numpy() == pattern[0], (a == C).numpy() == pattern[1]
            stable &= bool(same[0].all() and same[1].all())
            values.append(float((a * alpha_bar).sum() + r * rho_bar))
        if not stable:
            skipped += 1
            continue
        fd = (values[0] - values[1]) / (2.0 * FD_STEP)
        worst = max(worst, abs(fd - float(grad[i, j])) / scale)
        used += 1
    return _record(
        f"gradient.finite_differences[n={n}]", used > 0 and worst <= FD_TOL, worst, FD_TOL,
        f"{used} coordinates compared (central differences, h={FD_STEP:g}), {skipped} skipped "
        "because the partition changed at +-h (a kink)")


def _check_after_deletions(torch):
    from svtoolkit import IncrementalSVDD
    from svtoolkit.torch import gate_from_solver

    n = 80
    keys, C, sigma = _problem(n)
    solver = IncrementalSVDD(C, sigma)
    solver.extend(keys)
    for victim in np.random.default_rng(SEED).choice(n, 12, replace=False):
        solver.remove(int(victim))
    kept = solver.keys
    alpha_bar, rho_bar = _cotangents(torch, len(kept))
    x = torch.tensor(kept, requires_grad=True)
    alpha, rho = gate_from_solver(solver, x)
    (grad,) = torch.autograd.grad((alpha * alpha_bar).sum() + rho * rho_bar, x)
    system = solver.margin_system()
    margin = np.searchsorted(solver.ids, system.margin_ids)
    error = np.searchsorted(solver.ids, system.error_ids)
    x_ref = torch.tensor(kept, requires_grad=True)
    (grad_ref,) = torch.autograd.grad(
        _dense_scalar(torch, x_ref, sigma, C, margin, error, alpha_bar, rho_bar), x_ref)
    value = float((grad - grad_ref).abs().max() / grad_ref.abs().max())
    return _record("gradient.after_deletions", value <= DENSE_TOL, value, DENSE_TOL,
                   f"n={n}, 12 deletions, |S|={len(margin)}, |E|={len(error)}; no re-solve")


def _check_no_factorization(torch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from svtoolkit.torch import SVAttention, svdd_gate

    class Detector(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.hits = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(tag in func.__name__ for tag in FACTORIZATION_OPS):
                self.hits.append(func.__name__)
            return func(*args, **(kwargs or {}))

    keys, C, sigma = _problem(64)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.tensor(keys, requires_grad=True)
    v = torch.randn(64, 3, generator=gen, dtype=torch.float64)
    q = torch.randn(5, D, generator=gen, dtype=torch.float64)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    out = SVAttention(C, sigma)(x, v, q)
    loss = (alpha**2).sum() + rho + out.sum()
    with Detector() as det:
        torch.autograd.grad(loss, x)
    # positive control: the detector sees the solve in a dense reference's backward
    alpha_bar, rho_bar = _cotangents(torch, 64)
    margin = np.flatnonzero((alpha.detach().numpy() > 0) & (alpha.detach().numpy() < C))
    error = np.flatnonzero(alpha.detach().numpy() == C)
    x2 = torch.tensor(keys, requires_grad=True)
    dense = _dense_scalar(torch, x2, sigma, C, margin, error, alpha_bar, rho_bar)
    with Detector() as control:
        torch.autograd.grad(dense, x2)
    return _record("gradient.no_factorization_in_backward", not det.hits and bool(control.hits),
                   len(det.hits), 0,
                   f"ATen ops seen in the backward of svdd_gate + SVAttention: {det.hits}; the "
                   f"detector's positive control saw {sorted(set(control.hits))}")


def run(quick: bool = True) -> list[dict]:
    """Run the gradient checks; ``quick`` uses n in {16, 64} (about 10 s), else up to 512."""
    try:
        import torch
    except ImportError:
        return [{"name": "gradient", "passed": None, "value": None, "tolerance": None,
                 "op": None, "skipped": True,
                 "detail": "not run: torch is not installed (pip install 'svtoolkit[torch]')"}]
    sizes = (16, 64) if quick else (16, 64, 256, 512)
    records = [_check_dense(torch, n) for n in sizes]
    records += [_check_finite_differences(torch, n, 40 if quick else 120) for n in sizes[:2]]
    records.append(_check_after_deletions(torch))
    records.append(_check_no_factorization(torch))
    return records


if __name__ == "__main__":
    import json
    import sys

    results = run(quick="--full" not in sys.argv)
    print(json.dumps(results, indent=2))
    sys.exit(1 if any(r["passed"] is False for r in results) else 0)
