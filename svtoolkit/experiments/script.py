"""The command line and the outputs of the example scripts that are not sweeps of
:mod:`svtoolkit.experiments.cli` (ECG retention, exact edit, skewed redundancy, text memory,
TinyLM training, trained recall memory).

They take the family's flags where these apply: ``--quick`` (seconds; the tests use it), the
default (scaled to a 2-core CPU), ``--paper`` (the published protocol, its estimated cost
printed first; refused with a message where the script has none), ``--out DIR`` (default
:data:`~svtoolkit.experiments.cli.DEFAULT_OUT` under the working directory), ``--jobs N``
where cells are independent, ``--device {cpu,cuda}`` where torch trains, ``--no-progress``.
Every JSON they write carries the run record of :func:`svtoolkit.experiments.record.run_record`
(commit and dirty flag, CPU, threads, the full configuration), taken when the run starts.

Importing this module imports neither torch nor matplotlib: ``--help`` works on a plain
install.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import DEFAULT_OUT
from .record import run_record

__all__ = ["Outputs", "check_device", "check_jobs", "parser", "refuse_paper", "scale_of"]


def parser(doc, *, extra, paper=None, jobs=False, device=False):
    """The command line of one script.

    Parameters
    ----------
    doc : str
        The script's docstring (the ``--help`` text).
    extra : str
        The ``pip install`` extras the script needs beyond the package, e.g. ``"text,examples"``.
    paper : str or None
        What ``--paper`` runs; None when no published protocol exists for the script (the flag
        is then listed, says so, and :func:`refuse_paper` refuses it).
    jobs : bool
        Offer ``--jobs`` (the script has independent cells).
    device : bool
        Offer ``--device {cpu,cuda}`` (torch trains in the script).

    Returns
    -------
    argparse.ArgumentParser
    """
    description = f"{doc.rstrip()}\n\nNeeds: pip install 'svtoolkit[{extra}]'\n"
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true",
                       help="a pipeline check in seconds (the numbers mean nothing)")
    scale.add_argument("--paper", action="store_true",
                       help=(f"the published protocol: {paper}; prints its estimated cost "
                             "before it starts") if paper else
                       ("no published protocol exists for this script: refused (the default "
                        "is the run to use)"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results directory (default: ./{DEFAULT_OUT})")
    if jobs:
        p.add_argument("--jobs", type=int, default=1,
                       help="cells in parallel on a joblib pool (1: in process)")
    if device:
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="where torch trains (cuda: refused when no CUDA device is "
                            "present; the exact fp64 solver stays on the CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    return p


def scale_of(args):
    """``"quick"``, ``"paper"`` or ``"default"`` from the parsed flags."""
    return "quick" if args.quick else "paper" if args.paper else "default"


def refuse_paper(args, name):
    """Exit status 2 (after a message on stderr) when ``--paper`` was given to a script without
    a published protocol, else None."""
    if not args.paper:
        return None
    print(f"{name}: no published protocol exists for this script, so --paper is refused "
          "(nothing was run); run it without --paper for its default scale", file=sys.stderr)
    return 2


def check_jobs(args):
    """Exit status 2 (after a message) for ``--jobs`` below 1, else None."""
    if getattr(args, "jobs", 1) < 1:
        print(f"--jobs must be >= 1; got {args.jobs}", file=sys.stderr)
        return 2
    return None


def check_device(args):
    """Exit status 2 (after a message) for ``--device cuda`` without a CUDA device, else None.

    Imports torch only when cuda was asked for.
    """
    if getattr(args, "device", "cpu") != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available (torch.cuda.is_available() is "
              "False); nothing was run", file=sys.stderr)
        return 2
    return None


class Outputs:
    """Where one run writes, and the run record its JSON carries.

    The files are ``<out>/<name><suffix>.*`` with the suffix ``""`` for the default scale and
    ``_quick`` / ``_paper`` otherwise (the family's naming). The run record is taken once, at
    construction: the code that runs is the code of that moment.

    Parameters
    ----------
    out : path-like
        The results directory (created).
    name : str
        File stem of the outputs.
    scale : {"quick", "default", "paper"}
    config : dict
        The full configuration of the run (JSON-serialisable).
    jobs : int
        Cells run in parallel.
    """

    def __init__(self, out, name, scale, config, *, jobs=1):
        self.dir = Path(out).resolve()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name + ("" if scale == "default" else f"_{scale}")
        self.stem = self.dir / self.name
        self.record = run_record(config, jobs=jobs)
        self.written = []

    def path(self, suffix):
        """``<out>/<name><scale suffix><suffix>`` (e.g. ``".md"``, ``".cells.jsonl"``)."""
        return self.dir / (self.name + suffix)

    def write_json(self, payload):
        """Write ``payload`` plus ``"record"`` (the run record) to ``<stem>.json``; returns the
        path."""
        path = self.path(".json")
        path.write_text(json.dumps({**payload, "record": self.record}, indent=2) + "\n")
        self.note(path)
        return path

    def write_text(self, suffix, text):
        """Write ``text`` to ``<stem><suffix>``; returns the path."""
        path = self.path(suffix)
        path.write_text(text)
        self.note(path)
        return path

    def figure(self, suffix=".png"):
        """The path of a figure, after selecting matplotlib's non-interactive Agg backend
        (matplotlib is imported here, never at import time)."""
        import matplotlib

        matplotlib.use("Agg")
        path = self.path(suffix)
        self.note(path)
        return path

    def note(self, path):
        """List ``path`` among the files :meth:`report` prints."""
        if path not in self.written:
            self.written.append(path)

    def report(self):
        """Print where the results were written."""
        print("results: " + ", ".join(str(p) for p in self.written), flush=True)
