"""Orchestration of ``python -m verification``: run every check, write the report, exit 1 on
any failure.

Sections (docs/verification.md): 1-3 the solver against the reference (:mod:`.exactness`), 4 exact
forgetting per regime (:mod:`.forgetting`), 5 the planted secret (:mod:`.secret`), 6 certified
eviction (:mod:`.eviction`), 7 extension checks (:mod:`.extensions`). The trials of 4 and 5
run on the chosen backend (:mod:`.backends`); the rest runs in this process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .backends import describe_backend, map_tasks
from .environment import environment
from .eviction import run_eviction
from .exactness import run_exactness
from .extensions import run_extensions
from .forgetting import REGIMES, SKIPPED_REGIMES, regime_checks, summarize
from .records import failed, skipped_check
from .secret import SECRET, secret_checks, summarize_secret

__all__ = ["Config", "run_suite", "main", "exit_status", "QUICK_TRIALS", "FULL_TRIALS"]

#: Trials per regime of the default (quick) run and of ``--full``.
QUICK_TRIALS = 100
FULL_TRIALS = 300
DEFAULT_OUT = Path("verification") / "report"


@dataclass
class Config:
    """What to run and where.

    Attributes
    ----------
    full : bool
        300 trials per regime instead of :data:`QUICK_TRIALS`.
    trials : int or None
        Trials per regime (overrides ``full``).
    seed : int
        Base seed; every seed used is derived from it and printed in the report.
    jobs : int
        1 = in process; otherwise joblib ``n_jobs``.
    dask_scheduler : str or None
        Dask scheduler address (takes precedence over ``jobs``).
    regimes : tuple of str
        Regimes of the forgetting sweep.
    extensions : bool
        Run the ``verification/check_*.py`` extension modules.
    extension_package : str
        Package searched for extension modules.
    progress : bool
        Show progress bars.
    out : Path or None
        Output directory (None: write nothing).
    """

    full: bool = False
    trials: int | None = None
    seed: int = 0
    jobs: int = 1
    dask_scheduler: str | None = None
    regimes: tuple = tuple(REGIMES)
    extensions: bool = True
    extension_package: str = "verification"
    progress: bool = True
    out: Path | None = DEFAULT_OUT
    argv: list = field(default_factory=list)

    @property
    def n_trials(self):
        """Trials per regime."""
        if self.trials is not None:
            return self.trials
        return FULL_TRIALS if self.full else QUICK_TRIALS

    def seeds(self):
        """Every seed of the run, by section."""
        trial_seeds = (self.seed, self.seed + self.n_trials - 1)
        return {
            "base": self.seed,
            "exactness (stream, removal, round trip)": self.seed,
            "forgetting trials (per regime)": list(trial_seeds),
            "forgetting generator streams": {name: REGIMES[name].stream for name in
                                             self.regimes},
            "planted secret trials": [self.seed, self.seed + SECRET["trials"] - 1],
            "planted secret stream": SECRET["stream"],
            "eviction contexts": self.seed,
        }


def _sweep_tasks(config):
    seeds = range(config.seed, config.seed + config.n_trials)
    forget = [("forget", name, s) for name in config.regimes for s in seeds]
    secret = [("secret", s) for s in range(config.seed, config.seed + SECRET["trials"])]
    return forget + secret


def _digest(trials):
    text = json.dumps(trials, sort_keys=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _regime_entries(config, trials):
    regimes, records = {}, []
    for name in config.regimes:
        summary = summarize(trials[name])
        summary["label"] = REGIMES[name].label
        summary["description"] = REGIMES[name].description
        summary["goals"] = dict(REGIMES[name].goals)
        regimes[name] = summary
        records += regime_checks(name, summary)
    for name, reason in SKIPPED_REGIMES.items():
        regimes[name] = {"trials": 0, "skipped": reason, "partition_match": None,
                         "dev_median": None, "dev_p95": None, "dev_mean": None,
                         "dev_worst": None, "decay_dev_median": None}
        records.append(skipped_check(f"forget.{name}", reason))
    return regimes, records


def run_suite(config):
    """Run every check.

    Returns
    -------
    dict
        ``checks`` (records), ``regimes``, ``secret``, ``exactness``, ``eviction``,
        ``extensions``, ``trials`` (every trial record), ``meta`` (seeds, backend, timings).
    """
    import svtoolkit

    start = time.perf_counter()
    timings = {}
    svtoolkit.warmup()

    t = time.perf_counter()
    exact_records, exactness = run_exactness(config.seed)
    timings["exactness"] = time.perf_counter() - t

    t = time.perf_counter()
    tasks = _sweep_tasks(config)
    results = map_tasks(tasks, jobs=config.jobs, dask_scheduler=config.dask_scheduler,
                        progress=config.progress, desc="forgetting + secret trials")
    timings["trials"] = time.perf_counter() - t
    pairs = list(zip(tasks, results, strict=True))
    trials = {name: [r for task, r in pairs if task[:2] == ("forget", name)]
              for name in config.regimes}
    trials["secret"] = [r for task, r in pairs if task[0] == "secret"]
    regimes, forget_records = _regime_entries(config, trials)
    secret = summarize_secret(trials["secret"])

    t = time.perf_counter()
    eviction_records, eviction = run_eviction(config.seed)
    timings["eviction"] = time.perf_counter() - t

    t = time.perf_counter()
    if config.extensions:
        extension_records, modules = run_extensions(quick=not config.full,
                                                    package=config.extension_package)
    else:
        extension_records, modules = [], []
    timings["extensions"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - start

    checks = (exact_records + forget_records + secret_checks(secret) + eviction_records
              + extension_records)
    return {
        "checks": checks,
        "regimes": regimes,
        "secret": secret,
        "exactness": exactness,
        "eviction": eviction,
        "extensions": modules,
        "trials": trials,
        "meta": {
            "quick": config.trials is None and not config.full,
            "trials_per_regime": config.n_trials,
            "seeds": config.seeds(),
            "backend": describe_backend(config.jobs, config.dask_scheduler),
            "trials_digest": _digest(trials),
            "timings_s": timings,
            "command": " ".join(["python -m verification", *config.argv]).strip(),
            "environment": environment(),
        },
    }


# ---------------------------------------------------------------------------------- console
def _fmt(value):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    if isinstance(value, float):
        return f"{value:.2e}"
    return str(value)


def format_check(record):
    """One console line: PASS/FAIL/SKIP, name, value, op and tolerance."""
    if record.get("passed") is None:
        return f"SKIP  {record['name']:<42} {record.get('detail', '')}"
    verdict = "PASS" if record["passed"] else "FAIL"
    op = record.get("op") or ""
    return (f"{verdict}  {record['name']:<42} {_fmt(record['value']):>10}  "
            f"(tolerance {op} {_fmt(record['tolerance'])})")


def print_summary(results, wall, stream=None):
    """Print every check and the regime table (to ``stream``, default stdout)."""
    from .report import regime_table

    stream = sys.stdout if stream is None else stream

    for record in results["checks"]:
        print(format_check(record), file=stream)
    print(file=stream)
    print(regime_table(results["regimes"]), file=stream)
    bad = failed(results["checks"])
    skipped = sum(r.get("passed") is None for r in results["checks"])
    passed = sum(r.get("passed") is True for r in results["checks"])
    print(f"\n{passed} passed, {len(bad)} failed, {skipped} skipped in {wall:.1f} s "
          f"({results['meta']['backend']})", file=stream)


# ---------------------------------------------------------------------------------- CLI
def build_parser():
    """The argument parser of ``python -m verification``."""
    parser = argparse.ArgumentParser(
        prog="python -m verification",
        description="Independent audit of svtoolkit's exact solver against the QP reference: "
                    "solver vs reference, exact forgetting vs retraining, the planted secret, "
                    "certified eviction, and registered extension checks. Exit status 1 if any "
                    "check fails.")
    parser.add_argument("--full", action="store_true",
                        help=f"{FULL_TRIALS} trials per regime (default {QUICK_TRIALS})")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials per regime (overrides --full)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="joblib workers for the trials (default 1: in process; -1: all)")
    parser.add_argument("--dask-scheduler", metavar="ADDRESS", default=None,
                        help="run the trials on this Dask distributed scheduler")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output directory (default {DEFAULT_OUT}/)")
    parser.add_argument("--regimes", default=",".join(REGIMES),
                        help=f"comma-separated regimes (default {','.join(REGIMES)})")
    parser.add_argument("--no-extensions", action="store_true",
                        help="do not run verification/check_*.py modules")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def config_from_args(argv=None):
    """Parse the command line into a :class:`Config`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    regimes = tuple(r for r in args.regimes.split(",") if r)
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        raise SystemExit(f"unknown regime(s) {unknown}; choose from {list(REGIMES)}")
    if args.trials is not None and args.trials < 1:
        raise SystemExit("--trials must be >= 1")
    return Config(full=args.full, trials=args.trials, seed=args.seed, jobs=args.jobs,
                  dask_scheduler=args.dask_scheduler, regimes=regimes,
                  extensions=not args.no_extensions, progress=not args.no_progress,
                  out=args.out, argv=argv)


def main(argv=None):
    """Entry point of ``python -m verification``; returns the exit status."""
    from .report import write_report

    config = config_from_args(argv)
    start = time.perf_counter()
    results = run_suite(config)
    if config.out is not None:
        paths = write_report(results, config.out)
        results["meta"]["outputs"] = [str(p) for p in paths]
    wall = time.perf_counter() - start
    print_summary(results, wall)
    if config.out is not None:
        print(f"report: {config.out / 'report.md'}")
    return exit_status(results)


def exit_status(results):
    """1 if any check failed, else 0 (skipped checks are not failures)."""
    return 1 if failed(results["checks"]) else 0
