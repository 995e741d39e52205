"""Shared setup of the replay tests: the dcplan package must import (its extension built)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: spawns one process per Gloo rank")


@pytest.fixture(scope="session")
def dcplan_module():
    try:
        import dcplan
    except ImportError as e:
        pytest.skip(f"dcplan extension not importable: {e}")
    return dcplan
