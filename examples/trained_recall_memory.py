"""Auditable memory on a trained recall model: forgetting, exact editing and certified
eviction (Forgetful Attention (arXiv:2607.12204), §6 first paragraph, Fig. 4).

A multi-query associative-recall model is trained (continuous MQAR: every fact is one token
``[key; value]``, a query is ``[key + noise; 0]``;
:class:`svtoolkit.torch.learned_keys.RecallModel`, trained by
:func:`~svtoolkit.torch.learned_keys.train_recall_model` through the toolkit's one trainer). Its learned projections are then frozen: for fresh scenes, the fact tokens' keys
``k_i`` (the layer's RMS-normalised ``W_k`` projections), values ``v_i`` and the queries'
``q`` are computed in float64, and the memory over the keys is the exact fp64 solver
(:class:`svtoolkit.IncrementalSVDD`, fixed C). A query reads ``o(q) = sum_i a_i k(q, k_i) v_i /
sum_i a_i k(q, k_i)`` (the layer's RBF readout) and the model's own output projection and value
head turn ``o`` into a value vector, decoded to the nearest candidate value. Three panels:

* **(a) forgetting one fact.** 8 facts, one query per fact. One fact is removed by exact
  decrement (``IncrementalSVDD.remove``); every fact is asked again. Reported: the rate at which
  the forgotten fact is still answered (chance = 1/8), the fraction of the other facts answered,
  the readout deviation from a fresh solve on the retained facts (exactness), and the same
  for coefficient decay (the forgotten key's coefficient times gamma, left in memory).
* **(b) exact remove-and-add edit** ("carol -> cairo" becomes "carol -> tokyo"). Fact 2's
  token is removed and the token ``[key_2; value_1]`` (the model's own projections of the new
  fact) is admitted. Reported: the edited fact answers the new value, the others are intact,
  and the old binding's residual influence - the largest readout deviation (over all queries)
  from a memory built from scratch on the edited facts - for the exact edit and for decay
  (old coefficient times gamma, new fact admitted). The paper's decay figure (1.15) measures
  decay without the new fact against a refit on the retained facts; that variant is reported
  too.
* **(c) certified eviction under redundancy.** 2 rare facts (one token each) and 3 dense
  facts (4 near-duplicate tokens each, key jitter 0.01); a rare fact is asked. The budget is
  the exact gate's support size ``|S u E|``. Policies: the certified support set; H2O heavy
  hitters scored by the context tokens' own learned queries with attention probabilities
  (normalised RBF weights) and with raw kernel mass; recency; random. Every policy is read by
  the same uniform RBF readout over its kept tokens (as in §5's matched-budget protocol);
  the gated readout over the kept tokens is reported beside it. Reported: the rate at which
  the rare fact is answered.

Every number of panels (a)-(c) comes from the exact fp64 solver on the trained model's frozen
keys; the model's recall@1 comes from its torch layer (batched gate it trained with, and the
exact gate).

Scales: ``--quick`` (a pipeline check, seconds), the default (3 seeds, 500 training steps,
300 scenes and 300 eviction trials per seed; about a minute per seed on one core) and
``--paper`` (one model trained as in the paper's reference code - 500 steps, seed 0 - and its
120 eviction trials; its estimated cost, from step and panel times measured now, is printed
first). Outputs ``<out>/trained_recall_memory<suffix>.{json,md,png}`` (suffix ``_quick`` /
``_paper`` for those scales; ``--out`` defaults to ``./svtoolkit-results``); the JSON carries
the run record. Each seed is one cell, appended to ``<stem>.cells.jsonl`` when it finishes:
rerunning the command skips finished seeds (a changed protocol makes new cells), and
``--jobs N`` runs seeds in parallel.

Run::

    python examples/trained_recall_memory.py --quick
    nice -n 10 python examples/trained_recall_memory.py --out examples/results
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from svtoolkit.experiments.script import (
    Outputs,
    check_device,
    check_jobs,
    parser,
    scale_of,
)

#: Scales: training steps, scenes per seed for panels (a) and (b), eviction trials (c), seeds.
PROTOCOLS = {
    "quick": dict(steps=60, scenes=8, trials=8, seeds=(0,)),
    "default": dict(steps=500, scenes=300, trials=300, seeds=(0, 1, 2)),
    "paper": dict(steps=500, scenes=1, trials=120, seeds=(0,)),
}
#: Coefficient-decay factors of the baseline.
GAMMAS = (0.1, 0.01)
#: Panel (b): the edited fact ("carol") and the fact whose value it takes ("tokyo").
EDITED, NEW_VALUE_OF = 2, 1
#: Panel (c): the redundant context of the paper's reference code.
N_RARE, N_DENSE, COPIES, JITTER = 2, 3, 4, 0.01
POLICIES = ("certified", "h2o_prob", "h2o_mass", "recency", "random")

#: Forgetful Attention (arXiv:2607.12204), §6 and Fig. 4 (one model, one scene per panel for
#: (a) and (b); (c) over trials).
PUBLISHED = {
    "model_recall_at_1": 1.0,
    "forget.forgotten_answered": "chance",
    "forget.others_answered": 1.0,
    "edit.residual_exact": "0 (machine precision)",
    "edit.residual_decay_paper_0.01": 1.15,
    "evict.certified.uniform": 1.0,
    "evict.h2o_mass.uniform": 0.21,
}


# ------------------------------------------------------------------------------ the memory
def rbf(Q, K, sigma):
    """exp(-||q - k||^2 / sigma^2) of Q (m, D) against K (n, D), coordinate differences."""
    return np.exp(-((Q[:, None, :] - K[None, :, :]) ** 2).sum(-1) / sigma**2)


class Memory:
    """One exact fp64 solver per head over the fact tokens' keys, indexed by token."""

    def __init__(self, keys, C, sigma):
        from svtoolkit import IncrementalSVDD

        self.C, self.sigma = C, sigma
        self.keys = {}
        self.solvers = [IncrementalSVDD(C, sigma) for _ in range(keys.shape[1])]
        self.ids = [{} for _ in self.solvers]
        for token, key in enumerate(keys):
            self.add(token, key)

    def add(self, token, key):
        """Admit token ``token`` with key (H, D) by exact increments."""
        self.keys[token] = key
        for h, solver in enumerate(self.solvers):
            self.ids[h][token] = solver.add(key[h])

    def remove(self, token):
        """Exact decrement of token ``token`` in every head."""
        del self.keys[token]
        for h, solver in enumerate(self.solvers):
            solver.remove(self.ids[h].pop(token))

    def alpha(self, tokens):
        """Coefficients (H, len(tokens)) of the given tokens (0 where not held)."""
        out = np.zeros((len(self.solvers), len(tokens)))
        column = {t: j for j, t in enumerate(tokens)}
        for h, solver in enumerate(self.solvers):
            token_of = {i: t for t, i in self.ids[h].items()}
            for key_id, a in zip(solver.ids, solver.alpha, strict=True):
                out[h, column[token_of[int(key_id)]]] = a
        return out

    def support(self, tokens):
        """Per head, the boolean mask (len(tokens),) of the tokens with coefficient > 0."""
        return self.alpha(tokens) > 0

    def decision(self, probes):
        """Decision values (H, m) of probes (m, H, D)."""
        return np.stack([s.decision_function(probes[:, h]) for h, s in
                         enumerate(self.solvers)])


def readout(K, V, Q, weights, sigma):
    """Gated RBF readout per head: K (n, H, D), V (n, H, Dv), Q (m, H, D), weights (H, n) ->
    (m, H, Dv); a query with no weight reads 0."""
    out = np.zeros((Q.shape[0], K.shape[1], V.shape[2]))
    for h in range(K.shape[1]):
        w = rbf(Q[:, h], K[:, h], sigma) * weights[h][None, :]
        total = w.sum(1, keepdims=True)
        out[:, h] = np.divide(w @ V[:, h], total, out=np.zeros_like(out[:, h]),
                              where=total > 0)
    return out


def decoded(model, readouts, candidates):
    """Indices of the candidates (c, d_value) nearest to the model's outputs."""
    values = model.decode(readouts)
    return ((values[:, None, :] - candidates[None]) ** 2).sum(-1).argmin(-1)


# ------------------------------------------------------------------------------ panels
def scene(rng, cfg):
    """8 facts and one query per fact: tokens (n, d_in), queries (n, d_in), values (n, dv)."""
    n, dk, dv = cfg["n_facts"], cfg["d_key"], cfg["d_value"]
    keys, values = rng.standard_normal((n, dk)), rng.standard_normal((n, dv))
    queries = keys + cfg["key_noise"] * rng.standard_normal((n, dk))
    return (np.hstack([keys, values]), np.hstack([queries, np.zeros((n, dv))]), values)


def panel_forget(model, cfg, rng, forgotten):
    """Panel (a) on one scene: forget fact ``forgotten`` by exact decrement."""
    tokens, queries, values = scene(rng, cfg)
    n = len(tokens)
    _, K, V = model.project(tokens)
    Q = model.project(queries)[0]
    C, sigma = cfg["C"], cfg["sigma"]
    memory = Memory(K, C, sigma)
    everyone = list(range(n))
    full_alpha = memory.alpha(everyone)
    before = decoded(model, readout(K, V, Q, full_alpha, sigma), values) == np.arange(n)
    memory.remove(forgotten)
    kept = [t for t in everyone if t != forgotten]
    o_dec = readout(K[kept], V[kept], Q, memory.alpha(kept), sigma)
    after = decoded(model, o_dec, values) == np.arange(n)
    fresh = Memory(K[kept], C, sigma)
    o_ref = readout(K[kept], V[kept], Q, fresh.alpha(list(range(len(kept)))), sigma)
    probes = np.concatenate([K, Q])
    result = {
        "before_all": bool(before.all()),
        "forgotten_answered": bool(after[forgotten]),
        "others_answered": float(np.delete(after, forgotten).mean()),
        "readout_dev_exact": float(np.abs(o_dec - o_ref).max()),
        "decision_dev_exact": float(np.abs(memory.decision(probes)
                                           - fresh.decision(probes)).max()),
    }
    for gamma in GAMMAS:
        alpha = full_alpha.copy()
        alpha[:, forgotten] *= gamma
        o_decay = readout(K, V, Q, alpha, sigma)
        result[f"forgotten_answered_decay_{gamma}"] = bool(
            (decoded(model, o_decay, values) == np.arange(n))[forgotten])
        result[f"readout_dev_decay_{gamma}"] = float(np.abs(o_decay - o_ref).max())
    return result


def panel_edit(model, cfg, rng):
    """Panel (b) on one scene: fact EDITED takes the value of fact NEW_VALUE_OF."""
    tokens, queries, values = scene(rng, cfg)
    n, dk = len(tokens), cfg["d_key"]
    new_token = np.concatenate([tokens[EDITED, :dk], values[NEW_VALUE_OF]])
    _, K_all, V_all = model.project(np.vstack([tokens, new_token]))
    K, V, k_new = K_all[:n], V_all[:n], K_all[n]
    Q = model.project(queries)[0]
    C, sigma = cfg["C"], cfg["sigma"]
    expected = np.arange(n)
    expected[EDITED] = NEW_VALUE_OF
    memory = Memory(K, C, sigma)
    full_alpha = memory.alpha(list(range(n)))
    memory.remove(EDITED)
    memory.add(n, k_new)
    edited = [t for t in range(n) if t != EDITED] + [n]
    o_edit = readout(K_all[edited], V_all[edited], Q, memory.alpha(edited), sigma)
    answers = decoded(model, o_edit, values)
    fresh = Memory(K_all[edited], C, sigma)
    o_ref = readout(K_all[edited], V_all[edited], Q, fresh.alpha(list(range(n))), sigma)
    probes = np.concatenate([K_all, Q])
    both = Memory(K_all, C, sigma)  # old and new binding held together (decay's memory)
    both_alpha = both.alpha(list(range(n + 1)))
    kept = [t for t in range(n) if t != EDITED]
    retained = Memory(K[kept], C, sigma)
    o_retained = readout(K[kept], V[kept], Q, retained.alpha(list(range(n - 1))), sigma)
    result = {
        "edited_answers_new": bool(answers[EDITED] == NEW_VALUE_OF),
        "others_intact": float(np.delete(answers == expected, EDITED).mean()),
        "residual_exact": float(np.abs(o_edit - o_ref).max()),
        "decision_dev_exact": float(np.abs(memory.decision(probes)
                                           - fresh.decision(probes)).max()),
    }
    for gamma in GAMMAS:
        alpha = both_alpha.copy()
        alpha[:, EDITED] *= gamma
        o_decay = readout(K_all, V_all, Q, alpha, sigma)
        result[f"residual_decay_{gamma}"] = float(np.abs(o_decay - o_ref).max())
        result[f"edited_answers_new_decay_{gamma}"] = bool(
            decoded(model, o_decay, values)[EDITED] == NEW_VALUE_OF)
        alpha = full_alpha.copy()
        alpha[:, EDITED] *= gamma
        o_paper = readout(K, V, Q, alpha, sigma)
        result[f"residual_decay_paper_{gamma}"] = float(np.abs(o_paper - o_retained).max())
    return result


def redundant_context(rng, cfg):
    """N_RARE single tokens, then N_DENSE facts of COPIES near-duplicate tokens each."""
    dk, dv = cfg["d_key"], cfg["d_value"]
    base = rng.standard_normal((N_RARE + N_DENSE, dk))
    base_values = rng.standard_normal((N_RARE + N_DENSE, dv))
    owner = list(range(N_RARE)) + [N_RARE + j for j in range(N_DENSE) for _ in range(COPIES)]
    owner = np.array(owner)
    keys = base[owner].copy()
    keys[N_RARE:] += JITTER * rng.standard_normal(keys[N_RARE:].shape)
    tokens = np.hstack([keys, base_values[owner]])
    query = np.concatenate([base[0] + cfg["key_noise"] * rng.standard_normal(dk),
                            np.zeros(dv)])
    return tokens, query[None], base_values


def _selections(K, Qctx, budget, sigma, rng):
    """Per policy, the per-head kept token indices (each a sorted int array)."""
    from svtoolkit.selection import h2o_selection, random_selection, recency_selection

    n, H = K.shape[0], K.shape[1]
    out = {
        "h2o_prob": [h2o_selection(K[:, h], Qctx[:, h], budget, sigma=sigma, normalize=True)
                     for h in range(H)],
        "h2o_mass": [h2o_selection(K[:, h], Qctx[:, h], budget, sigma=sigma, normalize=False)
                     for h in range(H)],
        "recency": [recency_selection(n, budget)] * H,
    }
    out["random"] = [random_selection(n, budget, rng)] * H
    return out


def panel_evict(model, cfg, rng):
    """Panel (c) on one redundant context: is the queried rare fact answered after eviction?"""
    tokens, query, base_values = redundant_context(rng, cfg)
    n = len(tokens)
    Qctx, K, V = model.project(tokens)  # the context tokens' own queries score H2O
    q = model.project(query)[0]
    C, sigma = cfg["C"], cfg["sigma"]
    memory = Memory(K, C, sigma)
    alpha = memory.alpha(list(range(n)))
    support = alpha > 0
    budget = int(max(2, support.sum(1).max()))
    kept = {"certified": [np.flatnonzero(s) for s in support]}
    kept.update(_selections(K, Qctx, budget, sigma, rng))
    result = {"budget": budget, "n": n}
    masks = {"full": np.ones_like(support)}
    for policy, per_head in kept.items():
        mask = np.zeros_like(support)
        for h, idx in enumerate(per_head):
            mask[h, idx] = True
        masks[policy] = mask
    for policy, mask in masks.items():
        for name, weights in (("uniform", mask.astype(float)), ("gated", alpha * mask)):
            answer = decoded(model, readout(K, V, q, weights, sigma), base_values)[0]
            result[f"{policy}.{name}"] = bool(answer == 0)
        result[f"{policy}.rare_kept"] = bool(mask[:, 0].all())
    return result


# ------------------------------------------------------------------------------ one seed
def run_seed(seed, protocol, threads=1, device="cpu"):
    """Train the recall model of ``seed`` (on ``device``) and run the three panels on it."""
    from svtoolkit.torch.learned_keys import RECALL_MODEL_CONFIG, train_recall_model
    from svtoolkit.torch.threads import set_threads

    set_threads(threads)
    trained = train_recall_model(steps=protocol["steps"], seed=seed, device=device)
    cfg = {**RECALL_MODEL_CONFIG, **trained.config}
    model = trained.model._float64()
    rng = np.random.default_rng([seed, 2026])
    # the first scene forgets "carol", as the paper's single scene does; then every fact in turn
    forget = [panel_forget(model, cfg, rng, forgotten=(EDITED + i) % cfg["n_facts"])
              for i in range(protocol["scenes"])]
    edit = [panel_edit(model, cfg, rng) for _ in range(protocol["scenes"])]
    evict = [panel_evict(model, cfg, rng) for _ in range(protocol["trials"])]
    return {"seed": seed, "recall_at_1": trained.recall_at_1,
            "recall_at_1_exact": trained.recall_at_1_exact,
            "train_loss": list(trained.train_loss), "train_s": trained.seconds,
            "forget": _aggregate(forget), "edit": _aggregate(edit), "evict": _aggregate(evict)}


def _aggregate(records):
    """Means of every field over the scenes; for deviations also the median and the max."""
    out = {}
    for key in records[0]:
        values = np.array([r[key] for r in records], dtype=float)
        out[key] = float(values.mean())
        if "dev" in key or "residual" in key:
            out[key + ".median"] = float(np.median(values))
            out[key + ".max"] = float(values.max())
    return out


# ------------------------------------------------------------------------------ outputs
#: Table rows: (row key, label, where in a seed's result).
ROWS = [
    ("model_recall_at_1", "model recall@1, batched gate (torch layer)", ("recall_at_1",)),
    ("model_recall_at_1_exact", "model recall@1, exact fp64 gate (torch layer)",
     ("recall_at_1_exact",)),
    ("forget.before_all", "(a) all 8 facts answered before forgetting", ("forget", "before_all")),
    ("forget.forgotten_answered", "(a) forgotten fact still answered (exact decrement)",
     ("forget", "forgotten_answered")),
    ("forget.others_answered", "(a) other facts answered after forgetting",
     ("forget", "others_answered")),
    ("forget.forgotten_answered_decay_0.01", "(a) forgotten fact still answered, decay 0.01",
     ("forget", "forgotten_answered_decay_0.01")),
    ("forget.forgotten_answered_decay_0.1", "(a) forgotten fact still answered, decay 0.1",
     ("forget", "forgotten_answered_decay_0.1")),
    ("forget.readout_dev_exact", "(a) readout deviation from a retrain, exact (max)",
     ("forget", "readout_dev_exact.max")),
    ("forget.readout_dev_decay_0.01", "(a) readout deviation from a retrain, decay 0.01 "
     "(median)", ("forget", "readout_dev_decay_0.01.median")),
    ("edit.edited_answers_new", "(b) edited fact answers the new value (exact edit)",
     ("edit", "edited_answers_new")),
    ("edit.others_intact", "(b) other facts unchanged after the edit", ("edit", "others_intact")),
    ("edit.residual_exact", "(b) old binding's residual influence, exact edit (max)",
     ("edit", "residual_exact.max")),
    ("edit.decision_dev_exact", "(b) decision-function deviation from a refit, exact edit "
     "(max)", ("edit", "decision_dev_exact.max")),
    ("edit.residual_decay_0.01", "(b) residual influence, decay 0.01 + new fact (median)",
     ("edit", "residual_decay_0.01.median")),
    ("edit.residual_decay_paper_0.01", "(b) residual influence, decay 0.01 without the new "
     "fact, paper's measure (median)", ("edit", "residual_decay_paper_0.01.median")),
    ("edit.edited_answers_new_decay_0.01", "(b) edited fact answers the new value, decay 0.01 "
     "+ new fact", ("edit", "edited_answers_new_decay_0.01")),
    ("evict.budget", "(c) budget = support size |S u E| (tokens, of 14)", ("evict", "budget")),
    ("evict.full.uniform", "(c) rare fact answered, no eviction (uniform readout)",
     ("evict", "full.uniform")),
]
ROWS += [(f"evict.{p}.uniform", f"(c) rare fact answered, {label}", ("evict", f"{p}.uniform"))
         for p, label in (("certified", "certified eviction"),
                          ("h2o_prob", "H2O (attention probabilities)"),
                          ("h2o_mass", "H2O (kernel mass)"), ("recency", "recency"),
                          ("random", "random"))]
ROWS += [(f"evict.{p}.gated", f"(c) rare fact answered, {p}, gated readout of kept tokens",
          ("evict", f"{p}.gated")) for p in POLICIES]
ROWS += [(f"evict.{p}.rare_kept", f"(c) rare fact's token kept, {p}", ("evict", f"{p}.rare_kept"))
         for p in POLICIES]


def summarise(per_seed):
    rows = []
    for key, label, path in ROWS:
        values = []
        for result in per_seed:
            value = result
            for part in path:
                value = value[part]
            values.append(float(value))
        rows.append({"row": key, "label": label, "per_seed": values,
                     "mean": statistics.fmean(values),
                     "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "published": PUBLISHED.get(key)})
    return rows


def _fmt(value):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
        return f"{value:.1e}"
    return f"{value:.3f}"


def markdown(rows, scale_line):
    lines = ["| quantity | svtoolkit (mean ± std over seeds) | published |", "|---|---:|---:|"]
    for r in rows:
        ours = _fmt(r["mean"]) + (f" ± {_fmt(r['std'])}" if len(r["per_seed"]) > 1 else "")
        label = r["label"].replace("|", "\\|")  # |S u E| inside a table cell
        lines.append(f"| {label} | {ours} | {_fmt(r['published'])} |")
    lines += ["", scale_line, "",
              "Published values: Forgetful Attention (arXiv:2607.12204), §6 and Fig. 4 (one "
              "trained model; panels (a) and (b) on one scene each). Rates are fractions of "
              "scenes (a, b) or trials (c); deviations are max-abs differences of the "
              "attention readout o(q) over every query of a scene. 'chance' for (a) is 1/8."]
    return "\n".join(lines) + "\n"


def figure(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["row"]: r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    bars = [("before\n(all facts)", "forget.before_all"),
            ("forgotten\n(exact)", "forget.forgotten_answered"),
            ("others\n(exact)", "forget.others_answered"),
            ("forgotten\n(decay 0.01)", "forget.forgotten_answered_decay_0.01")]
    _bars(axes[0], bars, by, "answered (rate)", "(a) forget one fact")
    axes[0].axhline(1 / 8, color="0.5", ls=":", lw=0.8, label="chance 1/8")
    axes[0].legend(fontsize=7)
    res = [("exact edit", "edit.residual_exact"), ("decay 0.01\n+ new fact",
                                                   "edit.residual_decay_0.01"),
           ("decay 0.01\n(paper's)", "edit.residual_decay_paper_0.01")]
    ax = axes[1]
    ax.bar(range(len(res)), [max(by[k]["mean"], 1e-18) for _, k in res],
           color=["C0", "C3", "C1"])
    ax.set_yscale("log")
    ax.set_xticks(range(len(res)), [label for label, _ in res], fontsize=8)
    ax.set_ylabel("old binding's residual influence")
    ax.axhline(1.15, color="0.3", ls="--", lw=0.8, label="published decay 1.15")
    ax.legend(fontsize=7)
    ax.set_title("(b) remove-and-add edit", fontsize=9)
    bars = [(p.replace("_", "\n"), f"evict.{p}.uniform") for p in POLICIES]
    _bars(axes[2], bars, by, "rare fact answered (rate)", "(c) eviction under redundancy")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(ax, bars, by, ylabel, title):
    means = [by[k]["mean"] for _, k in bars]
    stds = [by[k]["std"] for _, k in bars]
    ax.bar(range(len(bars)), means, yerr=stds, capsize=3, color=[f"C{i}" for i in
                                                                   range(len(bars))])
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = parser(__doc__, extra="torch,examples", jobs=True, device=True,
               paper="one model trained as in the paper's reference code (500 steps, seed 0) "
                     "and its 120 eviction trials")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="training seeds (default: the scale's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/Numba threads of each cell (training itself runs on one)")
    return p.parse_args(argv)


def run_cell(cell):
    """One seed: train its model and run the three panels (the sweep's cell function)."""
    return run_seed(cell["seed"], cell["protocol"], cell["threads"], cell["device"])


def estimate_cost(protocol, seeds, jobs, probe_steps=(10, 30), probe_trials=4):
    """Seconds the run would take, from training and panel times measured now.

    Two models are trained for ``probe_steps`` steps: the difference of their times gives the
    time of a step, the rest the fixed cost of a training run (data, held-out scoring).
    ``probe_trials`` eviction panels are run on the second; a seed costs the fixed cost,
    ``steps`` training steps and ``2 scenes + trials`` panels at those rates (a forget or
    edit panel costs about one eviction panel). Returns ``(total_s, wall_s)`` with
    ``wall_s = total_s / jobs`` at most ``len(seeds)`` wide.
    """
    from svtoolkit.torch.learned_keys import RECALL_MODEL_CONFIG, train_recall_model

    short, long = (train_recall_model(steps=n, seed=seeds[0]) for n in probe_steps)
    per_step = max(0.0, long.seconds - short.seconds) / (probe_steps[1] - probe_steps[0])
    fixed = max(0.0, short.seconds - probe_steps[0] * per_step)
    cfg = {**RECALL_MODEL_CONFIG, **long.config}
    model = long.model._float64()
    rng = np.random.default_rng([seeds[0], 2026])
    start = time.perf_counter()
    for _ in range(probe_trials):
        panel_evict(model, cfg, rng)
    per_panel = (time.perf_counter() - start) / probe_trials
    per_seed = fixed + protocol["steps"] * per_step \
        + (2 * protocol["scenes"] + protocol["trials"]) * per_panel
    total = per_seed * len(seeds)
    return total, total / min(max(1, jobs), len(seeds))


def main(argv=None):
    args = parse_args(argv)
    for refused in (check_jobs(args), check_device(args)):
        if refused:
            return refused
    scale = scale_of(args)
    protocol = dict(PROTOCOLS[scale])
    seeds = tuple(args.seeds) if args.seeds else protocol["seeds"]
    protocol.pop("seeds")
    from svtoolkit.sweep import cell_key, run_cells
    from svtoolkit.torch.learned_keys import RECALL_MODEL_CONFIG

    if scale == "paper":
        total, wall = estimate_cost(protocol, seeds, args.jobs)
        print(f"trained_recall_memory --paper: {len(seeds)} seed(s); estimated {total:.0f} s "
              f"of CPU, about {wall:.0f} s with --jobs {args.jobs} (from training and panel "
              "times measured now)", flush=True)
    model_cfg = {k: v for k, v in RECALL_MODEL_CONFIG.items()
                 if k not in ("context", "contexts", "dedup")}
    model_cfg["steps"] = protocol["steps"]
    redundant = {"rare": N_RARE, "dense": N_DENSE, "copies": COPIES, "jitter": JITTER}
    config = {"experiment": "trained_recall_memory", "scale": scale, "protocol": protocol,
              "model": model_cfg, "seeds": list(seeds), "device": args.device,
              "threads": args.threads, "gammas": list(GAMMAS),
              "redundant_context": redundant}
    out = Outputs(args.out, "trained_recall_memory", scale, config, jobs=args.jobs)
    # everything that decides a seed's numbers is in its cell (and so in its key)
    cells = [{"seed": int(seed), "protocol": protocol, "model": model_cfg,
              "device": args.device, "threads": args.threads, "gammas": list(GAMMAS),
              "redundant_context": redundant} for seed in seeds]
    keys = [cell_key(c) for c in cells]
    scale_line = (f"Scale '{scale}': RecallModel d_model {model_cfg['d_model']}, "
                  f"{model_cfg['n_heads']} head, {model_cfg['n_facts']} facts, C "
                  f"{model_cfg['C']}, sigma {model_cfg['sigma']} on RMS-normalised keys, "
                  f"{protocol['steps']} steps x batch {model_cfg['batch_size']}; "
                  f"{protocol['scenes']} scene(s) per seed for (a) and (b), "
                  f"{protocol['trials']} trials for (c); seeds {list(seeds)}; exact fp64 "
                  f"solver on the frozen learned keys.")
    start = time.perf_counter()

    def write(done):
        per_seed = [done[k] for k in keys if k in done]
        rows = summarise(per_seed) if per_seed else []
        payload = {"experiment": "trained_recall_memory", "scale": scale,
                   "protocol": protocol, "model": model_cfg, "seeds": list(seeds),
                   "seeds_done": len(per_seed), "device": args.device,
                   "gammas": list(GAMMAS), "redundant_context": redundant,
                   "scale_note": scale_line,
                   "wall_s_this_call": time.perf_counter() - start,
                   "per_seed": per_seed, "rows": rows}
        out.write_json(payload)
        table = markdown(rows, scale_line)
        out.write_text(".md", "# Auditable memory on a trained recall model "
                              "(Forgetful Attention, Fig. 4)\n\n" + table)
        return rows, table

    results = run_cells(run_cell, cells, results=out.path(".cells.jsonl"), jobs=args.jobs,
                        progress=not args.no_progress, desc=f"trained_recall_memory ({scale})",
                        on_result=write)
    rows, table = write(dict(zip(keys, results, strict=True)))
    figure(rows, out.figure(), f"trained recall model, exact fp64 memory ({scale} scale)")
    print(table)
    out.note(out.path(".cells.jsonl"))
    out.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
