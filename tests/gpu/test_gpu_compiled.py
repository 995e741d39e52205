"""Compiled replay on 2 GPUs (NCCL transport) against single-GPU training under torch.compile:
the CPU matrix of tests/train/test_compiled.py, Inductor generating GPU kernels. On 2 GPUs;
on a machine with one, world size 1 (the ops on their CUDA streams inside the graphs, without
communication).

Skipped, with the reason, where there is no GPU or dcplan is a CPU build.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train"))
import compiled_cases as cc  # noqa: E402
from mp_harness import entry, gpu_ranks, require_gpus, run_ranks  # noqa: E402
from train_harness import assert_trained_like  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [("base", s, 1) for s in (1, 2, 3)] + [("base", 3, 2), ("tied", 3, 1), ("twice", 3, 1), ("frozen", 3, 1)]
# fp32 (no TF32) on both sides; besides the order of the 2 ranks' gradient sum, cuBLAS and
# Triton may pick other kernels (another split of the reductions) for the half batch than for
# the whole one: the eager GPU matrix's tolerances (test_gpu_equivalence.py).
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def results(dcplan_module):
    require_gpus(dcplan_module, 1)
    import torch

    return run_ranks(cc.worker, min(gpu_ranks(), torch.cuda.device_count()), CASES, "cuda")


@pytest.mark.parametrize("variant,stage,accum", CASES, ids=[f"{v}-zero{s}-accum{a}" for v, s, a in CASES])
def test_compiled_matches_single_gpu(results, variant, stage, accum):
    res = entry(results, f"{variant}-zero{stage}-accum{accum}")
    assert_trained_like(res["value"], res["reference"], LOSS_TOL, PARAM_TOL)
