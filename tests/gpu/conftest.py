"""Setup of the GPU tests: the dcplan package (a CUDA build) and the shared cases of tests/python."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for d in (HERE, os.path.join(os.path.dirname(HERE), "python")):
    if d not in sys.path:
        sys.path.insert(0, d)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs 2 CUDA GPUs and a CUDA build of dcplan")


@pytest.fixture(scope="session")
def gpu_dcplan():
    """dcplan with its NCCL transport on a machine with at least 2 GPUs; skips (visibly) otherwise."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {n} (torch {torch.__version__})")
    try:
        import dcplan
    except ImportError as e:
        pytest.skip(f"dcplan extension not importable: {e}")
    if not dcplan._C.has_nccl():
        pytest.skip("dcplan._C was built without CUDA (build the cuda preset and set DCPLAN_BUILD_DIR)")
    return dcplan
