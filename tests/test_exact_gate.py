"""The differentiable exact gate (Forgetful Attention (arXiv:2607.12204), §3.3, App. A):
gradcheck, no-solve backward, dense implicit-function equality, kinks, warm-up, zero
denominators, student-teacher training.

**Local partition stability.** gradcheck perturbs inputs by eps = 1e-6; a perturbation that
moved a key across a set boundary would differentiate a different smooth piece. Every gradcheck
input here is chosen so that this cannot happen, and the test asserts it twice:

1. before: every margin coefficient is at least ``STABLE_FRACTION * C`` from both bounds and
   every error/reserve key has ``|g| >= STABLE_G`` (``assert_locally_stable``); and
2. during: every forward evaluation gradcheck makes records the partition read off alpha (the
   solver snaps bound coefficients to exactly 0 or C) and the test asserts that it never changed.

Seeds are fixed (``np.random.default_rng(seed)`` / ``torch.Generator().manual_seed(seed)``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from svtoolkit import IncrementalSVDD
from svtoolkit.torch import SVAttention, gate_from_solver, svdd_gate, svdd_gate_from_gram
from svtoolkit.torch._gate_autograd import rbf
from svtoolkit.torch.exact_gate import svdd_decision
from svtoolkit.torch.layers.set_readout import ZERO_DENOMINATOR, sv_attention
from svtoolkit.torch.ops.naive_gate import bordered_solve_gate

STABLE_FRACTION = 1e-3  # margin coefficients at least this fraction of C from either bound
STABLE_G = 1e-3  # |g| at least this on error and reserve keys
GRADCHECK = dict(eps=1e-6, atol=1e-7, rtol=1e-6)  # much tighter than the usual 1e-4 / 1e-3
DENSE_TOL = 1e-10  # relative, inverse-reusing VJP vs autograd through a bordered solve

# (n, d, C, sigma, seed): stable partitions with non-empty margin, error and reserve sets
GATE_PROBLEM = (12, 3, 0.15, 2.0, 4)  # |S| = 7, |E| = 3, |R| = 2
DECISION_PROBLEM = (14, 4, 0.12, 2.5, 0)  # |S| = 4, |E| = 6, |R| = 4
READOUT_PROBLEM = (12, 3, 0.15, 2.0, 10)  # |S| = 5, |E| = 4, |R| = 3
GRAM_PROBLEM = (10, 3, 0.15, 1.5, 1)  # |S| = 3, |E| = 5, |R| = 2


def make_keys(n, d, seed, scale=1.2):
    return np.random.default_rng(seed).standard_normal((n, d)) * scale


def solve(keys, C, sigma):
    solver = IncrementalSVDD(C, sigma)
    solver.extend(keys)
    return solver


def positions(solver, ids):
    return np.searchsorted(solver.ids, ids)


def assert_locally_stable(keys, C, sigma):
    """The partition cannot change under a 1e-6 perturbation (see the module docstring)."""
    solver = solve(keys, C, sigma)
    alpha = solver.alpha
    g = solver.decision_function(keys)  # f at the keys is g (k(x, x) = 1)
    margin = (alpha > 0.0) & (alpha < C)
    assert margin.any() and (alpha == C).any() and (alpha == 0.0).any()
    room = np.minimum(alpha[margin], C - alpha[margin])
    assert room.min() >= STABLE_FRACTION * C, f"margin coefficient {room.min():.2e} near a bound"
    assert np.abs(g[~margin]).min() >= STABLE_G, f"bound key with |g| = {np.abs(g[~margin]).min()}"
    return solver


class PartitionRecorder:
    """Remembers the partition (alpha == 0, alpha == C) of every forward evaluation."""

    def __init__(self, C):
        self.C, self.seen = C, set()

    def __call__(self, alpha):
        a = alpha.detach().numpy()
        self.seen.add(((a == 0.0).tobytes(), (a == self.C).tobytes()))
        return alpha

    def assert_fixed(self):
        assert len(self.seen) == 1, f"the partition changed during gradcheck ({len(self.seen)})"


def dense_implicit(K, margin, error, C):
    """Independent dense implicit-function reference: autograd through torch.linalg.solve."""
    n, m = K.shape[0], len(margin)
    M = torch.zeros(m + 1, m + 1, dtype=K.dtype)
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[margin][:, margin]
    c = torch.cat([K.new_tensor([1.0 - len(error) * C]),
                   torch.diagonal(K)[margin] - 2.0 * C * K[margin][:, error].sum(1)])
    u = torch.linalg.solve(M, c)
    alpha = torch.zeros(n, dtype=K.dtype)
    alpha[error] = C
    alpha = alpha.index_put((torch.as_tensor(margin),), u[1:])
    return alpha, u[0]


def rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


# --------------------------------------------------------------------------------------------
# gradcheck (float64, eps 1e-6)
# --------------------------------------------------------------------------------------------


def test_gradcheck_alpha_rho_wrt_gram():
    """A scalarization of (alpha, rho) with respect to every entry of K.

    The K-level forward holds the partition given and *verifies its KKT signs at every
    perturbed K* (it raises otherwise), so gradcheck passing proves the partition held.
    """
    n, d, C, sigma, seed = GRAM_PROBLEM
    keys = make_keys(n, d, seed)
    solver = assert_locally_stable(keys, C, sigma)
    margin = positions(solver, solver.margin_system().margin_ids)
    error = positions(solver, solver.error_ids)
    K = rbf(*(2 * [torch.tensor(keys)]), sigma=sigma).requires_grad_()
    weights = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    record = PartitionRecorder(C)

    def scalar(K):
        alpha, rho = svdd_gate_from_gram(K, C, margin=margin, error=error)
        return (record(alpha) * weights).sum() + 0.5 * rho + (alpha**2).sum()

    assert torch.autograd.gradcheck(scalar, (K,), **GRADCHECK)
    record.assert_fixed()


def test_gradcheck_alpha_rho_wrt_keys():
    n, d, C, sigma, seed = GATE_PROBLEM
    keys = make_keys(n, d, seed)
    assert_locally_stable(keys, C, sigma)
    x = torch.tensor(keys, requires_grad=True)
    record = PartitionRecorder(C)

    def outputs(x):
        alpha, rho = svdd_gate(x, C=C, sigma=sigma)
        return record(alpha), rho

    assert torch.autograd.gradcheck(outputs, (x,), **GRADCHECK)
    record.assert_fixed()


def test_gradcheck_decision_scores_wrt_keys():
    """f at the keys themselves and at fixed probes; keys enter through alpha, rho and k."""
    n, d, C, sigma, seed = DECISION_PROBLEM
    keys = make_keys(n, d, seed)
    assert_locally_stable(keys, C, sigma)
    probes = torch.tensor(np.random.default_rng(seed + 1).standard_normal((6, d)))
    x = torch.tensor(keys, requires_grad=True)
    record = PartitionRecorder(C)

    def scores(x):
        alpha, rho = svdd_gate(x, C=C, sigma=sigma)
        record(alpha)
        return svdd_decision(torch.cat([x, probes]), x, alpha, rho, sigma=sigma)

    assert torch.autograd.gradcheck(scores, (x,), **GRADCHECK)
    record.assert_fixed()


def test_gradcheck_readout_wrt_keys_values_queries():
    n, d, C, sigma, seed = READOUT_PROBLEM
    keys = make_keys(n, d, seed)
    assert_locally_stable(keys, C, sigma)
    rng = np.random.default_rng(seed + 1)
    values = torch.tensor(rng.standard_normal((n, 4)), requires_grad=True)
    queries = torch.tensor(rng.standard_normal((5, d)) * 1.2, requires_grad=True)
    x = torch.tensor(keys, requires_grad=True)
    layer = SVAttention(C, sigma)
    record = PartitionRecorder(C)

    def readout(x, v, q):
        out = layer(x, v, q)
        record(layer.last_info.alpha)
        assert not layer.last_info.zero_denominator.any()
        return out

    assert torch.autograd.gradcheck(readout, (x, values, queries), **GRADCHECK)
    record.assert_fixed()


# --------------------------------------------------------------------------------------------
# the backward performs no linear solve and no factorization
# --------------------------------------------------------------------------------------------

FACTORIZATION_OPS = ("solve", "inv", "lstsq", "cholesky", "lu", "qr", "svd", "eig", "triangular",
                     "pinv", "ldl")


class FactorizationDetector(TorchDispatchMode):
    """Records every ATen op whose name says it solves or factorizes (C++ calls included)."""

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(tag in name for tag in FACTORIZATION_OPS):
            self.hits.append(name)
        return func(*args, **(kwargs or {}))


def _raiser(name):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"{name} called during the backward")

    return forbidden


@contextlib.contextmanager
def no_python_solvers(monkeypatch):
    """Patch the Python-level solve/inverse/factorization entry points to raise."""
    import scipy.linalg

    targets = [(torch.linalg, n) for n in (
        "solve", "solve_ex", "inv", "inv_ex", "lstsq", "cholesky", "cholesky_ex", "lu",
        "lu_factor", "lu_factor_ex", "lu_solve", "solve_triangular", "pinv", "qr", "svd")]
    targets += [(torch, n) for n in ("inverse", "cholesky_solve", "cholesky_inverse", "lu",
                                     "lu_solve", "triangular_solve", "pinverse")]
    targets += [(np.linalg, n) for n in ("solve", "inv", "lstsq", "cholesky", "pinv", "qr")]
    targets += [(scipy.linalg, n) for n in ("solve", "inv", "lstsq", "lu_factor", "lu_solve",
                                            "cho_factor", "cho_solve", "solve_triangular")]
    with monkeypatch.context() as patch:
        for module, name in targets:
            if hasattr(module, name):
                patch.setattr(module, name, _raiser(f"{module.__name__}.{name}"))
        patch.setattr(torch.Tensor, "inverse", _raiser("Tensor.inverse"))
        yield


def test_backward_performs_no_solve_or_factorization(monkeypatch):
    n, d, C, sigma, seed = READOUT_PROBLEM
    rng = np.random.default_rng(seed)
    x = torch.tensor(make_keys(n, d, seed), requires_grad=True)
    v = torch.tensor(rng.standard_normal((n, 4)), requires_grad=True)
    q = torch.tensor(rng.standard_normal((5, d)), requires_grad=True)
    # forwards (the exact solver may factorize here; that is allowed)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    out = SVAttention(C, sigma)(x, v, q)
    K = rbf(x.detach(), x.detach(), sigma=sigma).requires_grad_()
    solver = solve(x.detach().numpy(), C, sigma)
    alpha_k, rho_k = svdd_gate_from_gram(
        K, C, margin=positions(solver, solver.margin_system().margin_ids),
        error=positions(solver, solver.error_ids))
    losses = [(alpha * torch.arange(n)).sum() + rho, (out**2).sum(), alpha_k.sum() * rho_k]
    with no_python_solvers(monkeypatch), FactorizationDetector() as detector:
        grads = [torch.autograd.grad(loss, inp) for loss, inp in
                 zip(losses, [(x,), (x, v, q), (K,)], strict=True)]
    assert detector.hits == []
    assert all(torch.isfinite(g).all() for gs in grads for g in gs)
    assert any(g.abs().max() > 0 for g in grads[0])

    # positive control: the detectors do catch a solve in a backward
    margin = np.flatnonzero((alpha_k.detach() > 0) & (alpha_k.detach() < C))
    error = np.flatnonzero(alpha_k.detach() == C)
    a_ref, r_ref = bordered_solve_gate(K, margin, error, C)
    with FactorizationDetector() as detector:
        torch.autograd.grad(a_ref.sum() * r_ref, K, retain_graph=True)
    assert detector.hits
    with no_python_solvers(monkeypatch), pytest.raises(AssertionError, match="during the backward"):
        dense_implicit(K, margin, error, C)


# --------------------------------------------------------------------------------------------
# equality with the dense implicit-function gradient
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, d, C, sigma, seed", [(12, 3, 0.15, 2.0, 4), (60, 5, 1 / 24, 1.8, 7),
                                                  (200, 6, 1 / 80, 2.5, 11)])
def test_gradients_equal_dense_implicit_function(n, d, C, sigma, seed):
    """Keys- and K-level gradients vs autograd through a fresh bordered solve, to 1e-10."""
    keys = make_keys(n, d, seed)
    solver = solve(keys, C, sigma)
    margin = positions(solver, solver.margin_system().margin_ids)
    error = positions(solver, solver.error_ids)
    gen = torch.Generator().manual_seed(seed)
    alpha_bar = torch.randn(n, generator=gen, dtype=torch.float64)
    rho_bar = torch.randn((), generator=gen, dtype=torch.float64)

    x = torch.tensor(keys, requires_grad=True)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    (g_keys,) = torch.autograd.grad((alpha * alpha_bar).sum() + rho * rho_bar, x)
    K = rbf(x, x, sigma=sigma)
    a_ref, r_ref = dense_implicit(K, margin, error, C)
    (g_keys_ref,) = torch.autograd.grad((a_ref * alpha_bar).sum() + r_ref * rho_bar, x)
    assert rel(alpha, a_ref) < 1e-12 and abs(float(rho.detach() - r_ref.detach())) < 1e-12
    assert rel(g_keys, g_keys_ref) < DENSE_TOL

    K = K.detach().requires_grad_()
    alpha_k, rho_k = svdd_gate_from_gram(K, C, margin=margin, error=error)
    (g_gram,) = torch.autograd.grad((alpha_k * alpha_bar).sum() + rho_k * rho_bar, K)
    a_ref, r_ref = dense_implicit(K, margin, error, C)
    (g_gram_ref,) = torch.autograd.grad((a_ref * alpha_bar).sum() + r_ref * rho_bar, K)
    assert rel(g_gram, g_gram_ref) < DENSE_TOL  # the same unsymmetrised matrix


def test_gram_gate_on_the_qp_reference_partition_matches_the_solver():
    """The reference's partition (found offline, by the test) gives the exact gate of keys."""
    pytest.importorskip("cvxpy")
    from svtoolkit.reference import solve_svdd

    n, d, C, sigma, seed = GATE_PROBLEM
    keys = make_keys(n, d, seed)
    x = torch.tensor(keys)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    K = rbf(x, x, sigma=sigma)
    ref = solve_svdd(K.numpy(), C)
    assert ref.polished
    alpha_k, rho_k = svdd_gate_from_gram(K, C, margin=ref.margin, error=ref.error)
    assert rel(alpha_k, alpha) < 1e-12 and abs(float(rho_k - rho)) < 1e-12


def test_gram_gate_requires_the_partition_and_never_imports_the_reference():
    import subprocess
    import sys

    K = rbf(torch.eye(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64), sigma=1.0)
    with pytest.raises(ValueError, match=r"give both margin and error"):
        svdd_gate_from_gram(K, 0.5)
    script = ("import sys, svtoolkit, svtoolkit.torch, svtoolkit.mlx\n"
              "print('cvxpy' in sys.modules, 'svtoolkit.reference' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.split() == ["False", "False"]


def test_gate_from_solver_after_deletions_matches_a_fresh_gate():
    """Differentiating a memory that had deletions, without re-solving: the same gradient as
    the gate of a fresh solve of the retained keys (exact unlearning, unique optimum)."""
    C, sigma = 1 / 20, 2.0
    keys = make_keys(40, 4, 3)
    solver = solve(keys, C, sigma)
    for victim in (5, 17, 0, 33, 21):
        solver.remove(victim)
    assert solver.certified and len(solver) == 35
    x_mem = torch.tensor(solver.keys, requires_grad=True)
    alpha, rho = gate_from_solver(solver, x_mem)
    x_new = torch.tensor(solver.keys, requires_grad=True)
    alpha_new, rho_new = svdd_gate(x_new, C=C, sigma=sigma)
    weights = torch.linspace(0.5, 2.0, 35, dtype=torch.float64)
    (g_mem,) = torch.autograd.grad((alpha * weights).sum() + rho, x_mem)
    (g_new,) = torch.autograd.grad((alpha_new * weights).sum() + rho_new, x_new)
    assert rel(alpha, alpha_new) < 1e-10
    assert rel(g_mem, g_new) < 1e-8


def test_empty_margin_set_gradient_is_that_of_the_midpoint_rule():
    """S empty (n C integral): alpha is locally constant; rho is the reported midpoint.

    Chosen so that the interval ends are unique (the runner-up -h on each side and the interval
    width are all > 1e-2 away), so a 1e-6 perturbation cannot swap them (asserted below).
    """
    C, sigma = 1 / 3, 2.0
    keys = np.random.default_rng(39).standard_normal((6, 2))
    solver = solve(keys, C, sigma)
    assert len(solver.margin_ids) == 0
    minus_h = 1.0 - 2.0 * rbf(*(2 * [torch.tensor(keys)]), sigma=sigma).numpy() @ solver.alpha
    lo = np.sort(minus_h[solver.alpha == 0.0])[::-1]
    hi = np.sort(minus_h[solver.alpha == C])
    assert min(lo[0] - lo[1], hi[1] - hi[0], hi[0] - lo[0]) > 1e-2
    x = torch.tensor(keys, requires_grad=True)
    alpha, rho = svdd_gate(x, C=C, sigma=sigma)
    assert abs(float(rho.detach()) - solver.rho) < 1e-15
    (g_alpha,) = torch.autograd.grad(alpha.sum() * 3.0, x, retain_graph=True)
    assert float(g_alpha.abs().max()) == 0.0
    assert torch.autograd.gradcheck(lambda x: svdd_gate(x, C=C, sigma=sigma)[1], (x,),
                                    **GRADCHECK)
    K = rbf(x, x, sigma=sigma).detach().requires_grad_()
    error = np.flatnonzero(solver.alpha == C)
    assert torch.autograd.gradcheck(
        lambda K: svdd_gate_from_gram(K, C, margin=[], error=error)[1], (K,), **GRADCHECK)


# --------------------------------------------------------------------------------------------
# SV-Attention: batching, support mask, zero denominators, warm-up, dtypes
# --------------------------------------------------------------------------------------------


def test_leading_dimensions_loop_over_independent_problems():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 16, 3, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 16, 4, generator=gen, dtype=torch.float64)
    q = torch.randn(2, 3, 7, 3, generator=gen, dtype=torch.float64)
    layer = SVAttention(0.2, 1.5)
    out = layer(x, v, q)
    assert out.shape == (2, 3, 7, 4)
    for i in range(2):
        for j in range(3):
            alpha, _ = svdd_gate(x[i, j], C=0.2, sigma=1.5)
            w = rbf(q[i, j], x[i, j], sigma=1.5) * alpha
            expected = (w @ v[i, j]) / w.sum(-1, keepdim=True)
            assert torch.allclose(out[i, j], expected, rtol=0, atol=1e-14)
            assert torch.equal(layer.last_info.alpha[i, j], alpha)


def test_support_mask_is_the_positive_coefficients_and_reserve_keys_are_inert():
    rng = np.random.default_rng(6)
    keys = torch.tensor(rng.standard_normal((40, 4)) * 1.3)
    values = torch.tensor(rng.standard_normal((40, 2)))
    queries = torch.tensor(rng.standard_normal((9, 4)))
    layer = SVAttention(0.1, 2.0)
    mask = layer.support_mask(keys)
    solver = solve(keys.numpy(), 0.1, 2.0)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, torch.tensor(solver.alpha > 0))
    n_support = int(mask.sum())
    assert 0 < n_support < 40
    # evicting the reserve keys changes no readout
    full = layer(keys, values, queries)
    kept = mask.nonzero().squeeze(1)
    alpha_full = layer.last_info.alpha[kept]
    w = rbf(queries, keys[kept], sigma=2.0) * alpha_full
    assert torch.allclose(full, (w @ values[kept]) / w.sum(-1, keepdim=True), rtol=0, atol=1e-14)


def test_zero_denominator_outputs_zero_with_a_flag_and_finite_gradients():
    n, d, C, sigma, seed = READOUT_PROBLEM
    rng = np.random.default_rng(seed)
    x = torch.tensor(make_keys(n, d, seed), requires_grad=True)
    v = torch.tensor(rng.standard_normal((n, 4)), requires_grad=True)
    far = torch.full((1, d), 60.0 * sigma, dtype=torch.float64)  # exp(-3600 * 3) underflows
    q = torch.cat([torch.tensor(rng.standard_normal((2, d))), far]).requires_grad_()
    out, info = sv_attention(x, v, q, C=C, sigma=sigma, return_info=True)
    assert info.zero_denominator.tolist() == [False, False, True]
    assert torch.equal(out[2], torch.zeros(4, dtype=torch.float64))
    assert bool(torch.isfinite(out).all())
    grads = torch.autograd.grad(out.sum(), (x, v, q))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert float(grads[2][2].abs().max()) == 0.0
    assert ZERO_DENOMINATOR == torch.finfo(torch.float64).tiny


def test_warmup_gate_raises_and_the_layer_reads_out_ungated():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)  # n C = 0.5 < 1
    v = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    q = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"warm-up"):
        svdd_gate(x, C=0.1, sigma=1.0)
    solver = solve(x.numpy(), 0.1, 1.0)
    with pytest.raises(RuntimeError, match=r"warm-up"):
        gate_from_solver(solver, x)
    out, info = sv_attention(x, v, q, C=0.1, sigma=1.0, return_info=True)
    k = rbf(q, x, sigma=1.0)
    assert torch.allclose(out, (k @ v) / k.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    assert bool(info.warmup) and bool(torch.isnan(info.rho))
    assert bool(SVAttention(0.1, 1.0).support_mask(x).all())


def test_float32_inputs_compute_in_float64_and_return_float32():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 3, generator=gen).requires_grad_()
    v = torch.randn(20, 2, generator=gen)
    q = torch.randn(4, 3, generator=gen)
    out = SVAttention(0.1, 1.5)(x, v, q)
    assert out.dtype == torch.float32
    expected = SVAttention(0.1, 1.5)(x.detach().double(), v.double(), q.double())
    assert torch.allclose(out.double(), expected, rtol=0, atol=1e-6)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def test_bad_input_raises_naming_the_problem():
    x = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"keys must be a torch.Tensor"):
        svdd_gate(x.numpy(), C=0.2, sigma=1.0)
    with pytest.raises(ValueError, match=r"keys must have shape \(n, d\)"):
        svdd_gate(x[None], C=0.2, sigma=1.0)
    with pytest.raises(ValueError, match=r"keys contains NaN or inf"):
        svdd_gate(x.clone().fill_(float("nan")), C=0.2, sigma=1.0)
    with pytest.raises(ValueError, match=r"sigma must be finite and > 0"):
        svdd_gate(x, C=0.2, sigma=0.0)
    solver = solve(x.numpy(), 0.2, 1.0)
    with pytest.raises(ValueError, match=r"keys differ from solver.keys"):
        gate_from_solver(solver, x + 1e-9)
    with pytest.raises(ValueError, match=r"shape \(10, 3\)"):
        gate_from_solver(solver, x[:9])
    with pytest.raises(ValueError, match=r"leading dimensions"):
        sv_attention(x, x[None], x, C=0.2, sigma=1.0)
    K = rbf(x, x, sigma=1.0)
    with pytest.raises(ValueError, match=r"not optimal for K"):
        svdd_gate_from_gram(K, 0.2, margin=[0, 1, 2], error=[3, 4])
    with pytest.raises(ValueError, match=r"give both margin and error"):
        svdd_gate_from_gram(K, 0.2, margin=[0])


EMPTY_SHAPES = {  # keys, values, queries
    "empty batch": ((0, 6, 3), (0, 6, 2), (0, 4, 3)),
    "empty inner batch": ((2, 0, 6, 3), (2, 0, 6, 2), (2, 0, 4, 3)),
    "no queries": ((6, 3), (6, 2), (0, 3)),
    "no value dims": ((2, 6, 3), (2, 6, 0), (2, 4, 3)),
}


@pytest.mark.parametrize("shapes", EMPTY_SHAPES.values(), ids=EMPTY_SHAPES.keys())
def test_zero_size_shapes_give_empty_outputs_of_the_right_shape(shapes):
    """m = 0 queries, dv = 0 value dimensions and an empty leading batch are not errors: the
    outputs (and info, and gradients) are empty tensors of the documented shapes."""
    gen = torch.Generator().manual_seed(7)
    x, v, q = (torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()
               for s in shapes)
    batch, (n, m, dv) = x.shape[:-2], (x.shape[-2], q.shape[-2], v.shape[-1])
    out, info = sv_attention(x, v, q, C=0.3, sigma=1.0, return_info=True)
    assert out.shape == (*batch, m, dv)
    assert info.alpha.shape == (*batch, n) and info.rho.shape == batch
    assert info.warmup.shape == batch and info.zero_denominator.shape == (*batch, m)
    grads = torch.autograd.grad(out.sum(), (x, v, q))
    assert [g.shape for g in grads] == [x.shape, v.shape, q.shape]
    layer = SVAttention(0.3, 1.0)
    assert layer(x, v, q).shape == out.shape
    assert layer.support_mask(x).shape == (*batch, n)
    if batch.numel():  # the gate is still computed: it does not depend on the queries
        alpha, _ = svdd_gate(x.reshape(-1, n, x.shape[-1])[0], C=0.3, sigma=1.0)
        assert torch.equal(info.alpha.reshape(-1, n)[0], alpha)


def test_no_keys_or_no_features_raise_naming_the_problem():
    v, q = torch.zeros(6, 2, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.float64)
    no_features = torch.zeros(6, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"keys must have at least one feature"):
        sv_attention(no_features, v, q, C=0.3, sigma=1.0)
    with pytest.raises(ValueError, match=r"keys must have at least one feature"):
        SVAttention(0.3, 1.0)(no_features, v, q)
    with pytest.raises(ValueError, match=r"keys must have at least one feature"):
        SVAttention(0.3, 1.0).support_mask(no_features)
    with pytest.raises(ValueError, match=r"keys must have at least one feature"):
        svdd_gate(no_features, C=0.3, sigma=1.0)
    no_keys = torch.zeros(0, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"keys must hold at least one key; got shape \(0, 3\)"):
        svdd_gate(no_keys, C=1.0, sigma=1.0)
    with pytest.raises(ValueError, match=r"keys must hold at least one key"):
        sv_attention(no_keys, v[:0], torch.zeros(2, 3, dtype=torch.float64), C=0.3, sigma=1.0)
    with pytest.raises(ValueError, match=r"keys must hold at least one key"):
        SVAttention(0.3, 1.0).support_mask(no_keys)


def test_gram_gate_refuses_partitions_it_would_misread():
    """Float positions were truncated and a bool mask read as the positions 0 and 1."""
    n, d, C, sigma, seed = GRAM_PROBLEM
    keys = make_keys(n, d, seed)
    solver = solve(keys, C, sigma)
    margin = positions(solver, solver.margin_system().margin_ids)
    error = positions(solver, solver.error_ids)
    K = rbf(*(2 * [torch.tensor(keys)]), sigma=sigma)
    as_mask = np.zeros(n, dtype=bool)
    as_mask[margin] = True
    with pytest.raises(TypeError, match=r"margin must hold integer positions.*bool"):
        svdd_gate_from_gram(K, C, margin=as_mask, error=error)
    with pytest.raises(TypeError, match=r"error must hold integer positions.*float64"):
        svdd_gate_from_gram(K, C, margin=margin, error=error + 0.5)
    with pytest.raises(ValueError, match=r"margin must be a 1-D sequence of positions"):
        svdd_gate_from_gram(K, C, margin=margin[None], error=error)
    with pytest.raises(ValueError, match=r"error positions must be in \[0, 10\)"):
        svdd_gate_from_gram(K, C, margin=margin, error=[n])
    alpha, _ = svdd_gate_from_gram(K, C, margin=torch.tensor(margin), error=list(error))
    np.testing.assert_allclose(alpha.numpy(), solver.alpha, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# usable, not merely correct: student-teacher training
# --------------------------------------------------------------------------------------------


def test_student_learns_teacher_mapping_loss_down_99_percent_in_200_steps():
    """A student with learnable key/value/query projections, trained by Adam through the exact
    gate's custom backward, matches a teacher SV-Attention mapping (Forgetful Attention
    (arXiv:2607.12204), §7: 99%)."""
    gen = torch.Generator().manual_seed(0)
    n, m, d_in, d = 14, 8, 5, 3
    tokens = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    probes = torch.randn(m, d_in, generator=gen, dtype=torch.float64)
    teacher = [torch.randn(d_in, d, generator=gen, dtype=torch.float64) for _ in range(3)]
    student = [(0.8 * torch.randn(d_in, d, generator=gen, dtype=torch.float64)).requires_grad_()
               for _ in range(3)]
    layer = SVAttention(C=0.3, sigma=2.0)

    def apply(w_k, w_v, w_q):
        return layer(tokens @ w_k, tokens @ w_v, probes @ w_q)

    with torch.no_grad():
        target = apply(*teacher)
    optimizer = torch.optim.Adam(student, lr=0.03)
    losses = []
    for _ in range(200):
        optimizer.zero_grad()
        loss = ((apply(*student) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = ((apply(*student) - target) ** 2).mean().item()
    assert not layer.last_info.warmup and all(np.isfinite(losses))
    assert final <= 0.01 * losses[0], f"loss {losses[0]:.4g} -> {final:.4g}"
