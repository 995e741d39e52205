"""The training-job suites (checkpoints, transformers models, activation checkpointing) use the
multi-process harness of tests/python."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.join(os.path.dirname(HERE), "python")):
    if path not in sys.path:
        sys.path.insert(0, path)

from mp_harness import dcplan_module  # noqa: E402,F401  (a fixture of every suite here)


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: spawns one process per Gloo rank")
