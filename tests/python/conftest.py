"""Shared setup of the runtime tests: the dcplan package must import (its extension built)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from mp_harness import dcplan_module  # noqa: E402,F401  (a fixture of every suite here)


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: spawns one process per Gloo rank")

