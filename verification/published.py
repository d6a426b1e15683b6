"""The published figures the suite puts beside its own (never used to decide a check).

Sources: Forgetful Attention: A Trainable Support-Vector Memory with Certified Selection and
Exact Unlearning (arXiv:2607.12204), §4, §7, App. C and, for the full Table 1 rows, the
evidence file stored with the paper's public reference implementation (``v3_evidence.json``:
300 trials per regime, nu = 0.4, kernel width 2).
"""

from __future__ import annotations

__all__ = ["SOLVER", "TABLE1", "SECRET", "EVICTION_SCOPE", "TABLE1_SOURCE"]

#: §7 "Maintained-solver and gradient verification".
SOLVER = {
    "exact.stream": 1.6e-6,  # worst decision-value gap over a 45-point stream
    "exact.removal": 2.7e-7,  # removal vs the batch optimum on the retained set
    "exact.round_trip": 4.4e-16,  # decrement o increment restores the state
}

TABLE1_SOURCE = ("Forgetful Attention (arXiv:2607.12204), Table 1, with the evidence file of its "
                 "public reference implementation (v3_evidence.json), 300 trials/regime")

#: Table 1: decision-function deviation of the decrement from a fixed-C refit.
#: ``row`` names the published row each of our regimes is compared with.
TABLE1 = {
    "gaussian": {"row": "Gaussian (n=24, d=6)", "trials": 300, "completed": 300,
                 "partition_match": 0.99, "dev_median": 2.4e-9, "dev_p95": 1.2e-7,
                 "dev_mean": 3.1e-5, "dev_worst": 6.4e-3, "decay_dev_median": 0.0826},
    "redundant": {"row": "Redundant (4x6 near-duplicates)", "trials": 300, "completed": 300,
                  "partition_match": 0.52, "dev_median": 5.7e-7, "dev_p95": 1.6e-4,
                  "dev_mean": 3.1e-5, "dev_worst": 9.6e-4, "decay_dev_median": 0.237},
    "shuttle": {"row": "MIMIC-IV (<=40 h, dedup 0.1)", "trials": 300, "completed": 299,
                "partition_match": 0.98, "dev_median": 1.6e-9, "dev_p95": 1.2e-7,
                "dev_mean": 5.6e-5, "dev_worst": 1.1e-2, "decay_dev_median": 0.149},
    # The paper's learned keys come from its trained recall (QA) model: the learned_recall regime.
    "learned_recall": {"row": "Learned keys (QA model W_k)", "trials": 300, "completed": 300,
                       "partition_match": 1.00, "dev_median": 4.5e-13, "dev_p95": 4.6e-12,
                       "dev_mean": 9.7e-13, "dev_worst": 1.1e-11,
                       "decay_dev_median": 0.0224},
}

#: §4 "Removing a planted secret" (30 trials).
SECRET = {
    "retrieval_before": 0.80,
    "retrieval_after_exact": 0.0,
    "readout_dev_exact": 8.9e-5,
    "decay_readout_dev": {0.5: 0.57, 0.1: 0.34, 0.01: 0.16},
    "decay_retrieval": {0.5: 0.80, 0.1: 0.40, 0.01: 0.07},
}

#: The point-in-time counterexample of the public reference implementation's tests and evidence
#: (3 keys, C = 1, kernel width 5).
EVICTION_SCOPE = {
    "readout_dev_now": 4.570994e-9,  # the authors' seed leaves the reserve coefficient unsnapped
    "evicted_alpha_after": 0.03327001,
    "decision_dev_after": 4.07857e-3,
}
