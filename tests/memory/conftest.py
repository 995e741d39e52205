"""Shared setup of the memory-model tests: the dcplan package must import (its extension built)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_TESTS = os.path.join(os.path.dirname(HERE), "python")
if PYTHON_TESTS not in sys.path:
    sys.path.insert(0, PYTHON_TESTS)

from mp_harness import dcplan_module  # noqa: E402,F401  (the fixture of tests/python)


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: spawns one process per Gloo rank")
