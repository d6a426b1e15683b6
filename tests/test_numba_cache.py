"""Where Numba's cache goes (svtoolkit/_jit.py) and the one-line notice of a first compilation
(svtoolkit/_warmup.py), each in a fresh interpreter: both are decided once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTICE_START = "svtoolkit: compiling the solver's kernels, once"


def _python(code, *, env, cwd, timeout=300, args=()):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout, check=True)


def _environ(**changes):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update({k: str(v) for k, v in changes.items()})
    return env


def _zipped_package(tmp_path):
    """svtoolkit's sources in a zip archive: a package directory no one can write to (not even
    root, unlike a directory without write permission). All of them: an editable install
    would supply a missing submodule from the checkout, a regular install (an sdist's) not."""
    archive = tmp_path / "svtoolkit.zip"
    package = ROOT / "svtoolkit"
    with zipfile.ZipFile(archive, "w") as z:
        for path in sorted(package.rglob("*.py")):
            if "__pycache__" not in path.parts:
                z.write(path, f"svtoolkit/{path.relative_to(package).as_posix()}")
    return archive


SHOW = ("import os, numba, svtoolkit._jit as j\n"
        "print(j.__file__)\n"
        "print(os.environ.get('NUMBA_CACHE_DIR'))\n"
        "print(numba.config.CACHE_DIR)\n")


def test_an_unwritable_package_caches_in_the_user_cache_directory(tmp_path):
    archive = _zipped_package(tmp_path)
    xdg = tmp_path / "xdg"
    out = _python(SHOW, env=_environ(PYTHONPATH=archive, XDG_CACHE_HOME=xdg), cwd=tmp_path)
    where, variable, numba_dir = out.stdout.splitlines()
    assert where.startswith(str(archive))
    assert variable == numba_dir == str(xdg / "svtoolkit" / "numba")


def test_without_xdg_cache_home_the_user_cache_is_under_home(tmp_path):
    archive = _zipped_package(tmp_path)
    home = tmp_path / "home"
    # a relative XDG_CACHE_HOME is invalid by the XDG rule and ignored
    out = _python(SHOW, env=_environ(PYTHONPATH=archive, HOME=home, XDG_CACHE_HOME="rel"),
                  cwd=tmp_path)
    assert out.stdout.splitlines()[1] == str(home / ".cache" / "svtoolkit" / "numba")


def test_a_numba_cache_dir_set_by_the_user_is_respected(tmp_path):
    archive = _zipped_package(tmp_path)
    mine = tmp_path / "mine"
    out = _python(SHOW, env=_environ(PYTHONPATH=archive, NUMBA_CACHE_DIR=mine,
                                     XDG_CACHE_HOME=tmp_path / "xdg"), cwd=tmp_path)
    assert out.stdout.splitlines()[1:] == [str(mine), str(mine)]


def test_a_writable_package_leaves_the_cache_beside_the_source(tmp_path):
    out = _python(SHOW, env=_environ(PYTHONPATH=ROOT, XDG_CACHE_HOME=tmp_path / "xdg"),
                  cwd=ROOT)
    where, variable, numba_dir = out.stdout.splitlines()
    assert where == str(ROOT / "svtoolkit" / "_jit.py")
    assert variable == "None" and numba_dir == ""


# two small kernels (the Gram and the cross RBF kernel): two compilations, one notice
COMPILE_TWO = ("import numpy as np\n"
               "from svtoolkit._warmup import announce_compilation\n"
               "from svtoolkit.kernels import rbf_kernel\n"
               "announce_compilation()\n"
               "announce_compilation()\n"
               "X = np.random.default_rng(0).standard_normal((4, 2))\n"
               "rbf_kernel(X, sigma=1.0)\n"
               "rbf_kernel(X, X[:2], sigma=1.0)\n")


def test_the_compile_notice_is_printed_once_and_not_when_the_cache_holds_the_kernels(tmp_path):
    env = _environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache")
    first = _python(COMPILE_TWO, env=env, cwd=tmp_path)
    assert first.stderr.count(NOTICE_START) == 1
    cached = _python(COMPILE_TWO, env=env, cwd=tmp_path)
    assert cached.stderr == ""


def test_a_closed_stderr_never_stops_a_compilation(tmp_path):
    """The line goes to stderr as it is when the compilation starts (a command's stderr may have
    been replaced since the notice was set up); one that cannot take it is skipped."""
    code = ("import io, sys, numpy as np\n"
            "from svtoolkit._warmup import announce_compilation\n"
            "from svtoolkit.kernels import rbf_kernel\n"
            "announce_compilation()\n"
            "gone = io.StringIO()\n"
            "gone.close()\n"
            "sys.stderr = gone\n"
            "print(rbf_kernel(np.zeros((1, 1)), sigma=1.0).tolist())\n")
    out = _python(code, env=_environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache"),
                  cwd=tmp_path)
    assert out.stdout.strip() == "[[1.0]]"


# On an empty cache, changes of an empty store (it loads without a kernel) refused for their
# input: the second process of the plan has started, and is stopped; this one compiles nothing.
REFUSED_COLD = """
import sys
from svtoolkit.cli import main
store = sys.argv[1]
main(["memory", "init", store, "--sigma", "1", "--C", "0.3"])
for argv in (["forget", store, "r9"], ["edit", store, "r9", "--value", "x"],
             ["add", store + ".missing", "--key", "1,2", "--value", "x"],
             ["add", store, "--key", "1,2", "--value-json", "[["],
             ["add", store, "--key", "1,2", "--value", "x", "--id", ""],
             ["add", store, "--key", "1,inf", "--value", "x"]):
    print(main(["memory", *argv]))
main(["memory", "list", store, "--json"])
"""


def test_a_change_refused_for_its_input_says_so_before_any_compilation(tmp_path):
    """A mistyped id or path fails at once, not after the minute a first change compiles."""
    from svtoolkit.exact._warmup import _usable_cpus

    env = _environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache")
    out = _python(REFUSED_COLD, env=env, cwd=tmp_path, args=[str(tmp_path / "s.db")])
    lines = out.stdout.splitlines()
    assert lines[1:7] == ["1"] * 6 and json.loads("".join(lines[7:])) == []
    errors = out.stderr.splitlines()
    assert len(errors) == 6 and all(line.startswith("error: ") for line in errors), errors
    assert "unknown record id 'r9'" in errors[0] and "No such file" in errors[2]
    assert NOTICE_START not in out.stderr
    if _usable_cpus() >= 2:  # the plan's root kernels, late in its child's work, never began
        assert not list((tmp_path / "cache").rglob("*walk-*.nbi"))


@pytest.mark.slow
def test_an_edit_of_a_value_alone_compiles_no_walk(tmp_path):
    """The solver does not move: on an empty cache only the load's kernels compile."""
    import numpy as np

    from svtoolkit.memory import ForgettableMemory

    store = tmp_path / "s.db"
    mem = ForgettableMemory(sigma=1.0, C=0.4)
    mem.extend(np.random.default_rng(0).standard_normal((5, 2)), list("abcde"))
    mem.save(store)
    env = _environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache")
    cli = "import sys\nfrom svtoolkit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    out = _python(cli, env=env, cwd=tmp_path, timeout=1200,
                  args=["memory", "edit", str(store), "r1", "--value", "B"])
    assert json.loads(out.stdout)["operation"] == "edit"
    assert ForgettableMemory.load(store).get("r1") == "B"
    cached = {p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.nbi")}
    assert "_walk.kernel_column" in cached  # the load's own kernels did compile
    assert not cached & {"_walk.walk", "_rest.settle", "_walk._leave", "_walk.insert_slot"}


@pytest.mark.slow
def test_the_first_cli_change_announces_its_compilation_and_the_second_does_not(tmp_path):
    env = _environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache")
    cli = "import sys\nfrom svtoolkit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    stores = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]

    def run(*argv):
        return subprocess.run([sys.executable, "-c", cli, *argv], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=1200, check=True)

    for store in stores:
        run("memory", "init", store, "--sigma", "1", "--C", "0.3")
    first = run("memory", "add", stores[0], "--key", "0,0", "--value", "a")
    assert first.stderr.count(NOTICE_START) == 1
    # the same change of another empty store: every kernel it needs is in the cache now
    cached = run("memory", "add", stores[1], "--key", "0,0", "--value", "a")
    assert NOTICE_START not in cached.stderr


def test_the_change_plan_compiles_each_kernel_once_with_its_number_of_arguments():
    from svtoolkit.exact._warmup import CHANGE_PLAN, change_kernels

    kernels = change_kernels()
    planned = [name for step in CHANGE_PLAN for side in step for name in side]
    assert sorted(planned) == sorted(kernels)  # each kernel in one step, on one side
    for dispatcher, types in kernels.values():
        assert len(types) == dispatcher.py_func.__code__.co_argcount


# In a fresh interpreter (Numba's cache beside the source, warm or not): the plan's kernels
# compiled for the types it names, then changes of a store through the CLI. A kernel whose
# dispatcher gains a signature in the changes was called with types the plan does not name.
AFTER_PLAN = """
import os, sys, tempfile
from numba.core.registry import CPUDispatcher
from svtoolkit._warmup import kernel_modules
from svtoolkit.cli import main
from svtoolkit.exact._warmup import change_kernels, compile_kernels, prepare_changes

def signatures():
    return {m.__name__ + "." + k: set(v.overloads) for m in kernel_modules()
            for k, v in vars(m).items() if isinstance(v, CPUDispatcher)}

compile_kernels(change_kernels())
idle = not prepare_changes()  # the cache holds every kernel now: nothing to do
before = signatures()
store = os.path.join(tempfile.mkdtemp(), "s.json")
for argv in (["init", store, "--sigma", "1", "--C", "0.3"],
             ["add", store, "--key", "1,2,3", "--value", "a"],
             ["add", store, "--key", "1,2,4", "--value", "b"],
             ["add", store, "--key", "0,2,4", "--value", "c"],
             ["add", store, "--key", "0,1,4", "--value", "d"],  # n C >= 1: warm-up ends
             ["forget", store, "r0"], ["edit", store, "r1", "--key", "0,0,1"],
             ["forget", store, "r2"]):
    try:
        main(["memory", *argv])
    except SystemExit as exc:
        assert not exc.code, argv
after = signatures()
print(idle, sorted(name for name in after if after[name] - before.get(name, set())))
"""


def test_after_the_change_plan_a_store_change_asks_for_no_other_signature(tmp_path):
    out = _python(AFTER_PLAN, env=_environ(PYTHONPATH=ROOT), cwd=tmp_path)
    assert out.stdout.splitlines()[-1] == "True []"


# On an empty cache: the plan in two processes, with every compilation in this one recorded.
PREPARE_COLD = """
import json, sys
from numba.core import event
from svtoolkit.exact._warmup import CHANGE_PLAN, prepare_changes

compiled = []

class Record(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev):
        pass

event.register("numba:compile", Record())
took = prepare_changes(deletions=sys.argv[2] == "all")
during = list(compiled)
from svtoolkit.cli import main
for argv in (["init", sys.argv[1], "--sigma", "1", "--C", "0.4"],
             ["add", sys.argv[1], "--key", "1,2", "--value", "a"],
             ["add", sys.argv[1], "--key", "0,2", "--value", "b"],
             ["add", sys.argv[1], "--key", "0,1", "--value", "c"]):  # n C >= 1: warm-up ends
    main(["memory", *argv])
admitted = len(compiled)
main(["memory", "forget", sys.argv[1], "r0"])
print(json.dumps({"took": took, "during": during, "after_adds": compiled[len(during):admitted],
                  "after_forget": compiled[admitted:]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["all", "admissions"])
def test_on_an_empty_cache_the_plan_compiles_in_two_processes_without_overlap(tmp_path,
                                                                             kernels):
    """The whole plan (a forget's, an edit's) or an admission's (``memory add``: without
    ``DELETION_ONLY``, which the first deletion then compiles)."""
    from svtoolkit.exact._warmup import CHANGE_PLAN, DELETION_ONLY, _usable_cpus

    if _usable_cpus() < 2:
        pytest.skip("one CPU: the plan compiles nothing in a second process")
    env = _environ(PYTHONPATH=ROOT, NUMBA_CACHE_DIR=tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", PREPARE_COLD, str(tmp_path / "s.json"),
                          kernels], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=1200, check=True)
    report = json.loads(out.stdout.splitlines()[-1])
    there = {name for _, side in CHANGE_PLAN for name in side}
    assert report["took"] is True
    assert "walk" in report["during"] and not there & set(report["during"])
    assert report["after_adds"] == []  # the admissions found every kernel compiled or cached
    if kernels == "all":
        assert report["after_forget"] == [] and set(DELETION_ONLY) <= set(report["during"])
    else:
        assert not set(DELETION_ONLY) & set(report["during"])
        assert set(DELETION_ONLY) <= set(report["after_forget"])
