"""svtoolkit._openmp: the OpenMP spin default set at import, and left alone when the user chose."""

import os
import subprocess
import sys

from svtoolkit._openmp import SPIN_COUNT, default_spin


def test_the_spin_default_is_set_only_where_the_user_chose_nothing():
    env = {}
    assert default_spin(env) and env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    for chosen in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(chosen)
        assert not default_spin(env) and env == chosen


def test_import_svtoolkit_sets_it_in_the_process_environment():
    """In a fresh process, so that the runtimes loaded after the import (and child processes)
    read it from the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    child = "import os; print(os.environ['GOMP_SPINCOUNT'])"
    code = ("import os, svtoolkit, subprocess, sys; print(os.environ['GOMP_SPINCOUNT'], "
            f"subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, "
            "text=True).stdout.strip())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.split() == [str(SPIN_COUNT)] * 2
    done = subprocess.run([sys.executable, "-c", "import os, svtoolkit; "
                           "print(os.environ.get('GOMP_SPINCOUNT'))"],
                          env={**env, "OMP_WAIT_POLICY": "PASSIVE"}, capture_output=True,
                          text=True, check=True, timeout=120)
    assert done.stdout.strip() == "None"
