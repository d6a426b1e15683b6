"""Check 5: removing a planted secret (Forgetful Attention (arXiv:2607.12204), §4).

Each trial (:func:`run_secret_trial`, a pure function of its seed) builds a context of 14
ordinary tokens and one secret token, inserted at a random position; keys from N(0, I_4),
sigma = 1.5, ``C = 1 / (nu n0) = 2/15`` (nu = 0.5, n0 = 15), fixed. Values are one-hot token
identities, so the secret's value is distinct from every other (the "distinctive pair").

Readout (docs/design.md §1): ``o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i)``.
*Retrieval*: a probe near the secret (its key plus 0.1 N(0, I)) decodes to the secret, i.e.
the nearest value to ``o(q)`` is the secret's.

Three layers are compared with a layer that **never held the secret** (a fresh build on the 14
ordinary tokens with the same C): exact forgetting (decrement of the secret) and decay (the
secret's coefficient multiplied by gamma, nothing re-solved). The readout deviation is the
largest ``|o_method(q) - o_never(q)|`` over the value coordinates and probes near every key.
"""

from __future__ import annotations

import numpy as np

from svtoolkit import IncrementalSVDD, rbf_kernel
from svtoolkit.data import gaussian_keys

from .published import SECRET as PUBLISHED
from .records import make_check

__all__ = ["SECRET", "run_secret_trial", "summarize_secret", "secret_checks"]

SECRET = {"ordinary": 14, "d": 4, "sigma": 1.5, "nu": 0.5, "n0": 15, "trials": 30,
          "probe_jitter": 0.1, "gammas": (0.5, 0.1, 0.01), "stream": 11}
#: The exact-forgetting readout must equal the never-held layer's to this.
READOUT_TOL = 1e-9


def readout(keys, alpha, values, Q, sigma):
    """``o(q) = sum a k(q, x) v / sum a k(q, x)`` for each row of Q (shape (m, dv))."""
    weights = rbf_kernel(Q, keys, sigma=sigma) * alpha[None, :]
    return (weights @ values) / weights.sum(axis=1, keepdims=True)


def _retrieves(o, values, target):
    """True when the nearest value (Euclidean) to the readout is ``values[target]``."""
    return bool(np.argmin(((values - o) ** 2).sum(axis=1)) == target)


def _layer(solver):
    return solver.keys, solver.alpha


def run_secret_trial(seed):
    """One planted-secret trial (pure function of ``seed``).

    Returns
    -------
    dict
        ``secret_set`` (0 reserve, 1 margin, 2 error, before forgetting),
        ``retrieved_before``, ``retrieved_exact``, ``retrieved_decay`` (by gamma),
        ``dev_exact``, ``dev_decay`` (by gamma), ``dev_full`` (the layer that still holds the
        secret), ``status``.
    """
    p = SECRET
    out = {"seed": int(seed), "status": "ok"}
    try:
        out.update(_secret_trial(np.random.default_rng([p["stream"], int(seed)])))
    except Exception as exc:
        out["status"] = f"error: {type(exc).__name__}: {exc}"
    return out


def _secret_trial(rng):
    p = SECRET
    n = p["ordinary"] + 1
    keys = gaussian_keys(n, p["d"], rng=rng)
    pos = int(rng.integers(n))  # the secret's slot in the stream
    values = np.eye(n)
    C = 1.0 / (p["nu"] * p["n0"])
    full = IncrementalSVDD(C, p["sigma"])
    ids = full.extend(keys)
    secret_set = int(1 * np.isin(ids[pos], full.margin_ids) + 2 * np.isin(ids[pos],
                                                                           full.error_ids))
    ordinary = np.delete(np.arange(n), pos)
    never = IncrementalSVDD(C, p["sigma"])
    never.extend(keys[ordinary])
    forgot = full.copy()
    forgot.remove(ids[pos])

    probe_secret = keys[pos] + p["probe_jitter"] * rng.standard_normal(p["d"])
    probes = np.vstack([keys + p["probe_jitter"] * rng.standard_normal(keys.shape),
                        probe_secret])
    o_never = readout(*_layer(never), values[ordinary], probes, p["sigma"])
    full_keys, full_alpha = _layer(full)
    o_full = readout(full_keys, full_alpha, values, probes, p["sigma"])
    o_exact = readout(*_layer(forgot), values[ordinary], probes, p["sigma"])
    result = {
        "secret_set": secret_set,
        "retrieved_before": _retrieves(o_full[-1], values, pos),
        "retrieved_exact": _retrieves(o_exact[-1], values, pos),
        "dev_full": float(np.max(np.abs(o_full - o_never))),
        "dev_exact": float(np.max(np.abs(o_exact - o_never))),
        "retrieved_decay": {}, "dev_decay": {},
    }
    for gamma in p["gammas"]:
        alpha = full_alpha.copy()
        alpha[pos] *= gamma
        o_decay = readout(full_keys, alpha, values, probes, p["sigma"])
        result["retrieved_decay"][str(gamma)] = _retrieves(o_decay[-1], values, pos)
        result["dev_decay"][str(gamma)] = float(np.max(np.abs(o_decay - o_never)))
    return result


def summarize_secret(trials):
    """Retrieval rates and worst readout deviations over the trials."""
    ok = [t for t in trials if t["status"] == "ok"]
    gammas = [str(g) for g in SECRET["gammas"]]

    def rate(key):
        return float(np.mean([t[key] for t in ok])) if ok else None

    return {
        "trials": len(trials),
        "completed": len(ok),
        "secret_in_reserve": sum(t["secret_set"] == 0 for t in ok),
        "retrieval_before": rate("retrieved_before"),
        "retrieval_after_exact": rate("retrieved_exact"),
        "readout_dev_exact": max((t["dev_exact"] for t in ok), default=None),
        "readout_dev_full": max((t["dev_full"] for t in ok), default=None),
        "decay_retrieval": {g: float(np.mean([t["retrieved_decay"][g] for t in ok]))
                            for g in gammas} if ok else {},
        "decay_readout_dev": {g: max(t["dev_decay"][g] for t in ok) for g in gammas}
        if ok else {},
        "errors": [{"seed": t["seed"], "status": t["status"]} for t in trials
                   if t["status"] != "ok"],
    }


def secret_checks(summary):
    """Check records of the planted-secret experiment."""
    n = summary["trials"]
    records = [make_check("secret.coverage", summary["completed"] / n if n else 0.0, 1.0,
                          op=">=", detail=f"{summary['completed']}/{n} trials completed")]
    if not summary["completed"]:
        return records
    records += [
        make_check("secret.retrieval_before", summary["retrieval_before"], 0.0, op=">",
                   detail="the secret must be retrievable before forgetting, or the test is "
                          f"vacuous (published {PUBLISHED['retrieval_before']:.0%}; the secret "
                          f"was a certified-inert reserve token in "
                          f"{summary['secret_in_reserve']}/{summary['completed']} trials)"),
        make_check("secret.readout_dev_exact", summary["readout_dev_exact"], READOUT_TOL,
                   detail="max |o_exact - o_never| over probes near every key and every value "
                          f"coordinate (published {PUBLISHED['readout_dev_exact']:.1e})"),
        make_check("secret.retrieval_after_exact", summary["retrieval_after_exact"], 0.0,
                   op="==", detail="probes near the secret decode to it after exact forgetting "
                                   "(published 0%)"),
    ]
    return records
