"""Setup of the GPU tests: the dcplan package (a CUDA build) and the shared cases of tests/python."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for d in (HERE, os.path.join(os.path.dirname(HERE), "python")):
    if d not in sys.path:
        sys.path.insert(0, d)

from mp_harness import dcplan_module, gpu_ranks, require_gpus  # noqa: E402,F401  (dcplan_module: a fixture)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs 2 CUDA GPUs ($DCPLAN_TEST_GPUS) and a CUDA build of dcplan")


@pytest.fixture(scope="session")
def gpu_dcplan(dcplan_module):
    """dcplan with its NCCL transport on a machine with gpu_ranks() GPUs; skips (visibly) otherwise."""
    require_gpus(dcplan_module, gpu_ranks())
    return dcplan_module
