"""Shared pytest configuration: make tests/naive.py importable and report the seeds policy."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_report_header(config):
    return "svtoolkit tests: every random draw uses np.random.default_rng(<fixed seed in the test>)"
