"""The runtime's budget guard on 2 GPUs (NCCL): the CPU case of tests/replay/test_budget_guard.py,
where the ranks agree on their excess with an all-reduce of a device tensor and read the caching
allocator's bytes."""
import os
import sys

from mp_harness import require_gpus

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "replay"))
from test_budget_guard import guard_case  # noqa: E402


def test_the_budget_guard_keeps_a_budget_on_nccl(dcplan_module, tmp_path):
    require_gpus(dcplan_module, 2)
    guard_case(tmp_path, "cuda")
