"""Shared pytest configuration: make tests/naive.py importable and report the seeds policy."""

import os
import sys

from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# The seeds policy holds for the property tests too: each draws the same examples on every run
# and machine (derandomize: the examples follow from the test itself), so the suite's verdict
# does not depend on the run. To search for new counterexamples: `python -m pytest
# --hypothesis-profile explore`.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("fixed")


def pytest_report_header(config):
    return ("svtoolkit tests: every random draw uses np.random.default_rng(<fixed seed in the "
            f"test>); hypothesis examples derandomized: {settings.default.derandomize}")
