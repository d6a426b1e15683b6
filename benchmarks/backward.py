"""Backward of the exact gate: inverse-reusing VJP vs OptNet-style KKT, dense solve, cvxpylayers.

Usage::

    python benchmarks/backward.py            # writes benchmarks/results/backward.{json,md}
    python benchmarks/backward.py --quick    # fewer repetitions (smoke run)

Problem per row: n keys in R^6 (standard normal, seed 20240 + n), sigma = median pairwise
distance, nu = 0.4 -> C = 1 / (nu n). The forward is shared and **not timed**: one exact fp64
solve (``IncrementalSVDD.extend``) gives the partition, alpha, rho and the maintained inverse
R. Cotangents ``alpha_bar`` (n) and ``rho_bar`` are fixed random draws. Every method returns
``dL/dK`` as an (n, n) float64 tensor; the gradients are checked against the inverse-reusing
VJP in the same run.

What is timed (wall clock, ``time.perf_counter_ns``, after warm-up; median, min, max):

* ``vjp`` - **ours**: ``torch.autograd.grad`` of ``(alpha, rho)`` w.r.t. K through
  :class:`GramGateFunction` (graph built beforehand): w = R^T u_bar, the rank-one blocks of
  App. A, one (n, n) scatter. No solve.
* ``vjp_keys`` - ours, fused with the kernel chain rule: ``torch.autograd.grad`` to the keys
  through :class:`ExactGateFunction` (reported for information; the others stop at K).
* ``optnet`` - (a) an OptNet-style backward (Amos & Kolter 2017): build the full (3n+1) KKT
  Jacobian of the QP (n coefficients, 2n box multipliers, 1 equality multiplier) and do one
  dense ``torch.linalg.solve`` with its transpose; assemble dL/dK. Everything it does is timed.
* ``optnet_factored`` - (a') the same backward in OptNet's own form: the Jacobian's LU factors
  come from the forward (OptNet reuses its interior-point factorisation; computed here
  beforehand and not timed, as ours' R is not), so only ``torch.linalg.lu_solve`` with J^T
  and the assembly are timed - the strongest form of the full-KKT peer.
* ``dense_vjp`` - (b) autograd through a fresh ``torch.linalg.solve`` of the bordered margin
  system: only the backward ``torch.autograd.grad`` is timed (the graph, including the solve and
  its LU, is built beforehand - the most favourable timing for (b)).
* ``dense_total`` - (b) including its own forward: build M and c from K, solve, backward.
* ``cvxpylayers`` - (c) only where n <= 30 (a separate row): the backward of a CvxpyLayer
  (diffcp, SCS eps 1e-12, dense derivative mode) on ``min ||L^T a||^2 - diag(K)^T a`` with
  L = cholesky(K) (alpha and the dual of sum(a) = 1, which is rho), chained to K by autograd.
  Only the backward is timed; its forward is a full cone solve. Its gradient is compared by
  symmetric parts (cholesky's backward spreads it over both triangles).
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.spatial.distance import pdist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

from svtoolkit import IncrementalSVDD  # noqa: E402
from svtoolkit.torch._gate_autograd import ExactGateFunction, GramGateFunction, rbf  # noqa: E402
from svtoolkit.torch.exact_gate import _state_from_solver  # noqa: E402
from svtoolkit.torch.ops.naive_gate import bordered_solve_gate  # noqa: E402

SIZES = (32, 128, 512)
CVXPYLAYERS_SIZE = 30  # (c) is measured only for n <= 30
PEERS = ("optnet", "optnet_factored", "dense")  # gradients held to GRAD_TOL of ours
D, NU, SEED = 6, 0.4, 20240
GRAD_TOL = 1e-10  # relative max-abs difference to the inverse-reusing VJP, (a) and (b)
RESULTS = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------
# the problem and the methods
# --------------------------------------------------------------------------------------------


def make_problem(n):
    rng = np.random.default_rng(SEED + n)
    keys = rng.standard_normal((n, D))
    sigma = float(np.median(pdist(keys)))
    C = 1.0 / (NU * n)
    solver = IncrementalSVDD(C, sigma)
    solver.extend(keys)  # the shared forward (not timed)
    state = _state_from_solver(solver, "cpu")
    gen = torch.Generator().manual_seed(SEED + n)
    alpha_bar = torch.randn(n, generator=gen, dtype=torch.float64)
    rho_bar = torch.randn((), generator=gen, dtype=torch.float64)
    x = torch.tensor(keys)
    K = rbf(x, x, sigma=sigma).detach()
    return dict(n=n, keys=keys, sigma=sigma, C=C, solver=solver, state=state, K=K,
                alpha_bar=alpha_bar, rho_bar=rho_bar)


def optnet_system(K, alpha, rho, C):
    """The (3n+1) x (3n+1) KKT Jacobian J of the QP at its solution (see
    :func:`optnet_backward`), written block by block into one preallocated matrix.

    Rows/columns: z (n), the multipliers of -z <= 0 and of z <= C (n each), nu (1). The
    multipliers are read off the gradient g = 2 K alpha - diag(K) + rho: g on reserve keys
    (alpha = 0), -g on error keys (alpha = C), 0 elsewhere.
    """
    n = K.shape[0]
    g = 2.0 * (K @ alpha) - torch.diagonal(K) + rho
    lam_lower = torch.where(alpha == 0.0, g, torch.zeros_like(g))
    lam_upper = torch.where(alpha == C, -g, torch.zeros_like(g))
    i = torch.arange(n)
    J = torch.zeros(3 * n + 1, 3 * n + 1, dtype=K.dtype)
    J[:n, :n] = 2.0 * K
    J[i, n + i] = -1.0  # G^T with G = [-I; I]
    J[i, 2 * n + i] = 1.0
    J[:n, 3 * n] = 1.0  # A^T
    J[n + i, i] = -lam_lower  # D(lam) G
    J[2 * n + i, i] = lam_upper
    J[n + i, n + i] = -alpha  # D(G z - h)
    J[2 * n + i, 2 * n + i] = alpha - C
    J[3 * n, :n] = 1.0  # A
    return J


def _optnet_grad(d, n, alpha):
    d_z = d[:n]
    return -2.0 * torch.outer(d_z, alpha) + torch.diag(d_z)


def _optnet_rhs(alpha_bar, rho_bar, n):
    return torch.cat([alpha_bar, torch.zeros(2 * n, dtype=alpha_bar.dtype), rho_bar.reshape(1)])


def optnet_backward(K, alpha, rho, C, alpha_bar, rho_bar):
    """(a) dL/dK by one dense solve with the full QP KKT Jacobian (3n + 1 unknowns).

    QP: min 1/2 z^T Q z + q^T z, A z = b, G z <= h with Q = 2K, q = -diag(K), A = 1^T, b = 1,
    G = [-I; I], h = [0; C 1]. Residual F = [Q z + q + G^T lam + A^T nu; D(lam)(G z - h);
    A z - b] at (z, lam, nu) = (alpha, multipliers, rho). With d = J^{-T} [z_bar; 0; nu_bar]:
    dL/dQ = -d_z z^T and dL/dq = -d_z, hence dL/dK = -2 d_z alpha^T + diag(d_z).
    """
    n = K.shape[0]
    J = optnet_system(K, alpha, rho, C)
    d = torch.linalg.solve(J.T, _optnet_rhs(alpha_bar, rho_bar, n))
    return _optnet_grad(d, n, alpha)


def optnet_factored_backward(LU, pivots, alpha, alpha_bar, rho_bar):
    """(a') The same gradient with J's LU factors computed beforehand, as OptNet reuses the
    factorisation of its interior-point forward: one solve with J^T (two triangular solves,
    O(n^2)) and the (n, n) assembly."""
    n = alpha.shape[0]
    rhs = _optnet_rhs(alpha_bar, rho_bar, n)[:, None]
    d = torch.linalg.lu_solve(LU, pivots, rhs, adjoint=True)[:, 0]
    return _optnet_grad(d, n, alpha)


def build_cvxpylayer(n, C):
    import cvxpy as cp
    from cvxpylayers.torch import CvxpyLayer

    a = cp.Variable(n)
    L = cp.Parameter((n, n))
    diag = cp.Parameter(n)
    total = cp.sum(a) == 1
    problem = cp.Problem(cp.Minimize(cp.sum_squares(L.T @ a) - diag @ a), [total, a >= 0, a <= C])
    assert problem.is_dpp()
    return CvxpyLayer(problem, parameters=[L, diag], variables=[a, total.dual_variables[0]])


#: SCS at eps 1e-12 reproduces alpha to ~1e-12; diffcp's "dense" derivative mode gives ~1e-13
#: gradients here (its default "lsqr" mode: ~1e-6) and is also faster at this size.
CVXPY_ARGS = {"solve_method": "SCS", "eps": 1e-12, "max_iters": 100000, "mode": "dense"}


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def timeit(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) * 1e-3)  # microseconds
    return {"median_us": statistics.median(samples), "min_us": min(samples),
            "max_us": max(samples), "reps": reps, "warmup": warmup}


def rel_diff(got, ref):
    return float((got - ref).abs().max() / ref.abs().max())


def sym(G):
    return 0.5 * (G + G.T)


def bench_row(p, reps, warmup, with_cvxpylayers=False):
    n, C, state = p["n"], p["C"], p["state"]
    abar, rbar = p["alpha_bar"], p["rho_bar"]
    K = p["K"].clone().requires_grad_()
    alpha = state.alpha
    rho = state.rho
    margin = state.margin.numpy()
    error = state.error.numpy()
    row = {"n": n, "d": D, "C": C, "sigma": p["sigma"], "margin": len(margin),
           "error": len(error), "reserve": n - len(margin) - len(error),
           "kkt_residual": p["solver"].kkt_residual(), "times": {}, "grad_rel_diff": {}}

    # ours
    out_ours = GramGateFunction.apply(K, state)

    def ours():
        return torch.autograd.grad(out_ours, K, (abar, rbar), retain_graph=True)[0]

    g_ours = ours()
    row["times"]["vjp"] = timeit(ours, reps, warmup)

    x = torch.tensor(p["keys"], requires_grad=True)
    out_keys = ExactGateFunction.apply(x, state, p["sigma"])

    def ours_keys():
        return torch.autograd.grad(out_keys, x, (abar, rbar), retain_graph=True)[0]

    g_keys = ours_keys()
    a_chk, r_chk = bordered_solve_gate(rbf(x, x, sigma=p["sigma"]), margin, error, C)
    g_keys_dense = torch.autograd.grad((a_chk * abar).sum() + r_chk * rbar, x)[0]
    row["grad_rel_diff"]["vjp_keys_vs_dense_keys"] = rel_diff(g_keys, g_keys_dense)
    row["times"]["vjp_keys"] = timeit(ours_keys, reps, warmup)

    # (a) OptNet-style full KKT
    def optnet():
        return optnet_backward(K.detach(), alpha, rho, C, abar, rbar)

    g_optnet = optnet()
    row["grad_rel_diff"]["optnet"] = rel_diff(g_optnet, g_ours)
    row["times"]["optnet"] = timeit(optnet, max(5, reps // 4) if n >= 256 else reps, warmup)

    # (a') the same with its factorisation from the forward (not timed, as ours' R is not)
    LU, pivots = torch.linalg.lu_factor(optnet_system(K.detach(), alpha, rho, C))

    def optnet_factored():
        return optnet_factored_backward(LU, pivots, alpha, abar, rbar)

    row["grad_rel_diff"]["optnet_factored"] = rel_diff(optnet_factored(), g_ours)
    row["times"]["optnet_factored"] = timeit(optnet_factored, reps, warmup)

    # (b) autograd through a fresh bordered solve
    out_dense = bordered_solve_gate(K, margin, error, C)

    def dense_vjp():
        return torch.autograd.grad(out_dense, K, (abar, rbar), retain_graph=True)[0]

    def dense_total():
        out = bordered_solve_gate(K, margin, error, C)
        return torch.autograd.grad(out, K, (abar, rbar))[0]

    g_dense = dense_vjp()
    row["grad_rel_diff"]["dense"] = rel_diff(g_dense, g_ours)
    row["grad_rel_diff"]["dense_total"] = rel_diff(dense_total(), g_ours)
    row["forward_check"] = {"alpha_rel_diff": rel_diff(out_dense[0].detach(), alpha),
                            "rho_abs_diff": abs(float(out_dense[1].detach() - rho))}
    row["times"]["dense_vjp"] = timeit(dense_vjp, reps, warmup)
    row["times"]["dense_total"] = timeit(dense_total, reps, warmup)

    if with_cvxpylayers:
        layer = build_cvxpylayer(n, C)
        K_c = p["K"].clone().requires_grad_()
        a_c, nu_c = layer(torch.linalg.cholesky(K_c), torch.diagonal(K_c), solver_args=CVXPY_ARGS)

        def cvx():
            return torch.autograd.grad((a_c, nu_c), K_c, (abar, rbar), retain_graph=True)[0]

        g_cvx = cvx()
        row["forward_check"]["cvxpylayers_alpha_rel_diff"] = rel_diff(a_c.detach(), alpha)
        row["forward_check"]["cvxpylayers_rho_abs_diff"] = abs(float(nu_c.detach() - rho))
        # symmetric parts: cholesky's backward spreads the gradient over both triangles
        row["grad_rel_diff"]["cvxpylayers_sym"] = rel_diff(sym(g_cvx), sym(g_ours))
        row["times"]["cvxpylayers"] = timeit(cvx, max(5, reps // 4), min(warmup, 2))
    else:
        row["times"]["cvxpylayers"] = None
        row["cvxpylayers_note"] = f"not measured: n = {n} > {CVXPYLAYERS_SIZE} (scope of (c))"

    t = row["times"]
    row["speedup_vs_optnet"] = t["optnet"]["median_us"] / t["vjp"]["median_us"]
    row["speedup_vs_optnet_factored"] = (t["optnet_factored"]["median_us"]
                                         / t["vjp"]["median_us"])
    row["speedup_vs_dense_vjp"] = t["dense_vjp"]["median_us"] / t["vjp"]["median_us"]
    row["speedup_vs_dense_total"] = t["dense_total"]["median_us"] / t["vjp"]["median_us"]
    if t["cvxpylayers"] is not None:
        row["speedup_vs_cvxpylayers"] = t["cvxpylayers"]["median_us"] / t["vjp"]["median_us"]
    row["grads_identical"] = all(row["grad_rel_diff"][k] <= GRAD_TOL for k in
                                 ("optnet", "optnet_factored", "dense", "dense_total",
                                  "vjp_keys_vs_dense_keys"))
    return row


# --------------------------------------------------------------------------------------------
# environment, report
# --------------------------------------------------------------------------------------------


def environment():
    cpu = cpu_model()
    versions = {"python": sys.version.split()[0], "svtoolkit": svtoolkit.__version__,
                "torch": torch.__version__, "numpy": np.__version__}
    for name in ("scipy", "numba", "cvxpy", "cvxpylayers", "diffcp", "scs"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - report what is there
            versions[name] = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15min": load, "platform": platform.platform(),
            "versions": versions}


def fmt(t):
    if t is None:
        return "not measured"
    return f"{t['median_us']:.0f} ({t['min_us']:.0f}-{t['max_us']:.0f})"


#: The heading of the main table (README.md shows it by this title).
TABLE_TITLE = "Backward time (microseconds) and gradient agreement"


def markdown(result):
    lines = [
        "# Exact-gate backward", "", f"## {TABLE_TITLE}", "",
        "| n | \\|S\\| / \\|E\\| | ours: VJP reusing R | (a) OptNet full KKT | (a') OptNet, "
        "factors reused | (b) dense VJP (graph prebuilt) | (b) dense incl. solve | "
        "(c) cvxpylayers | (a)/ours | (a')/ours | (b)/ours | max rel. grad diff (a), (a'), (b) "
        "| ours, keys-level fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t, gd = r["times"], r["grad_rel_diff"]
        cvx = fmt(t["cvxpylayers"])
        if t["cvxpylayers"] is not None:
            cvx += f"; sym. grad diff {gd['cvxpylayers_sym']:.1e}"
        else:
            cvx = "n/a (n > 30)"
        lines.append(
            f"| {r['n']} | {r['margin']} / {r['error']} | {fmt(t['vjp'])} | {fmt(t['optnet'])} | "
            f"{fmt(t['optnet_factored'])} | {fmt(t['dense_vjp'])} | {fmt(t['dense_total'])} | "
            f"{cvx} | {r['speedup_vs_optnet']:.0f}x | {r['speedup_vs_optnet_factored']:.1f}x | "
            f"{r['speedup_vs_dense_vjp']:.2f}x | {gd['optnet']:.1e}, {gd['optnet_factored']:.1e}, "
            f"{gd['dense']:.1e} | {fmt(t['vjp_keys'])} |"
        )
    env = result["environment"]
    lines += [
        "",
        "Times in microseconds: median (min-max) of the backward only (the exact forward is "
        "shared and not timed); see the docstring of benchmarks/backward.py for exactly what "
        "each column times. (b) 'graph prebuilt' times only autograd's backward of a graph "
        "whose solve and LU were done beforehand; 'incl. solve' adds that forward.",
        "(a') times what OptNet's backward costs when it reuses the factorisation of its "
        "interior-point forward (J's LU computed beforehand, as ours reuses R): one solve "
        "with J^T and the assembly.",
        f"Goal: (a)/ours >= 10 at n = 512, (b)/ours >= 1, gradients identical to "
        f"{GRAD_TOL:g} - met: {result['goal']['met']} ({result['goal']['detail']}).",
        f"Hardware: {env['cpu']}, {env['logical_cpus']} logical CPUs, torch threads "
        f"{env['torch_threads']}, load average {env['load_average_1_5_15min']}; "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
        f"Command: `{result['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for every method (default 1: on a shared "
                             "machine, OpenMP spin-waiting makes tiny ops take milliseconds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps, warmup = (20, 3) if args.quick else (200, 20)
    svtoolkit.warmup()  # Numba compile, excluded from everything

    try:
        import cvxpylayers  # noqa: F401
        have_cvxpylayers = True
    except ImportError:
        have_cvxpylayers = False

    rows = []
    sizes = ((CVXPYLAYERS_SIZE,) if have_cvxpylayers else ()) + SIZES
    for n in sizes:
        p = make_problem(n)
        with_cvx = have_cvxpylayers and n <= CVXPYLAYERS_SIZE
        row = bench_row(p, reps, warmup, with_cvxpylayers=with_cvx)
        if n <= CVXPYLAYERS_SIZE and not have_cvxpylayers:
            row["cvxpylayers_note"] = "not measured: cvxpylayers is not installed"
        rows.append(row)
        print(f"n={n}: ours {fmt(row['times']['vjp'])} us, optnet {fmt(row['times']['optnet'])}, "
              f"dense vjp {fmt(row['times']['dense_vjp'])}, grad diffs {row['grad_rel_diff']}",
              flush=True)

    big = [r for r in rows if r["n"] == max(SIZES)][0]
    met = (big["speedup_vs_optnet"] >= 10.0
           and all(r["speedup_vs_dense_vjp"] >= 1.0 for r in rows)
           and all(r["grads_identical"] for r in rows))
    result = {
        "benchmark": "exact gate backward (dL/dK from alpha_bar, rho_bar)",
        "command": "python benchmarks/backward.py" + (" --quick" if args.quick else "")
                   + (f" --threads {args.threads}" if args.threads != 1 else ""),
        "problem": {"d": D, "nu": NU, "C": "1 / (nu n)", "sigma": "median pairwise distance",
                    "seed": f"{SEED} + n", "keys": "standard normal"},
        "timed": {
            "vjp": "torch.autograd.grad through GramGateFunction (graph prebuilt): "
                   "w = R^T u_bar, rank-one blocks, (n, n) scatter; no solve",
            "vjp_keys": "torch.autograd.grad to the keys through ExactGateFunction (fused "
                        "kernel chain rule)",
            "optnet": "build the (3n+1) KKT Jacobian + one dense torch.linalg.solve + assemble",
            "optnet_factored": "the (3n+1) KKT Jacobian's LU from before (not timed): one "
                               "torch.linalg.lu_solve with J^T + assemble",
            "dense_vjp": "torch.autograd.grad through a prebuilt bordered-solve graph (LU from "
                         "the forward reused by autograd)",
            "dense_total": "build M and c from K + torch.linalg.solve + autograd backward",
            "cvxpylayers": "torch.autograd.grad through a prebuilt CvxpyLayer graph (diffcp "
                           "adjoint derivative, dense mode, SCS eps 1e-12) chained through "
                           "cholesky(K)",
        },
        "environment": environment(),
        "rows": rows,
        "goal": {"met": bool(met), "detail": (
            f"(a)/ours at n={big['n']}: {big['speedup_vs_optnet']:.0f}x, (a')/ours "
            f"{big['speedup_vs_optnet_factored']:.1f}x; min (b)/ours "
            f"{min(r['speedup_vs_dense_vjp'] for r in rows):.2f}x; max grad diff (a), (a'), (b) "
            f"{max(r['grad_rel_diff'][k] for r in rows for k in PEERS):.1e}")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backward.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "backward.md").write_text(markdown(result))
    print(markdown(result))
    for r in rows:
        if not r["grads_identical"]:
            raise SystemExit(f"gradient mismatch at n={r['n']}: {r['grad_rel_diff']}")
    return result


if __name__ == "__main__":
    main()
