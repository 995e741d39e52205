"""dcplan on 2 GPUs ($DCPLAN_TEST_GPUS; NCCL transport) against single-GPU training, and the CUDA kernels' semantics.

Skipped, with the reason, where there are fewer than 2 GPUs or dcplan is a CPU build.
"""
import pytest
import torch

import dist_cases
import gpu_worker
from mp_harness import (assert_matches_reference, assert_reduced_grads, entry, gpu_ranks, run_ranks,
                        selected_cases, skip_unselected)

pytestmark = pytest.mark.gpu

WS = gpu_ranks()
CASES = dist_cases.all_cases()


@pytest.fixture(scope="module")
def gpu_results(gpu_dcplan):
    return run_ranks(gpu_worker.worker, WS, selected_cases())


def test_ops_on_gpu(gpu_results):
    for rank, res in enumerate(gpu_results):
        assert "error" not in res["ops"], res["ops"].get("error")
        v = res["ops"]["value"]
        torch.testing.assert_close(v["allgather"], (torch.arange(9.0) + 100).view(3, 3))
        torch.testing.assert_close(v["allgather_bf16"], (torch.arange(14.0) + 300).view(2, 7).bfloat16())
        assert v["held_after_release"] == []
        assert v["held_after_prefetch"] == [0, 2, 3]
        torch.testing.assert_close(v["fused"][0], torch.arange(5.0))
        torch.testing.assert_close(v["fused"][1], torch.tensor([200.0]))
        torch.testing.assert_close(v["fused"][2], (torch.arange(14.0) + 300).view(2, 7))
        # The gather saw the write queued behind the sleep.
        torch.testing.assert_close(v["allgather_after_write"], (torch.arange(9.0) + 1100).view(3, 3))
        assert_reduced_grads(v, rank, WS)
        assert v["offload_pinned"]
        torch.testing.assert_close(v["offload_host"], v["offload_expected"])
        torch.testing.assert_close(v["reload"], v["offload_expected"])
        assert v["reload_device"] == f"cuda:{rank}"


def test_no_host_blocking(gpu_results):
    """Gather, wait, reduce and end_backward queue work and return: the GPU is still busy with
    the ~0.1 s sleep queued before them when they return."""
    for rank, res in enumerate(gpu_results):
        v = res["ops"]["value"]
        assert v["stream_busy_after_ops"], f"rank {rank}: the stream was idle when the ops returned"
        assert v["host_seconds_while_busy"] < 0.05, v["host_seconds_by_op"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_single_gpu(gpu_results, case):
    skip_unselected(case.name)
    res = entry(gpu_results, case.name)
    got, ref = res["value"], res["reference"]
    bf16 = case.variant == "bf16"
    # fp32 on the GPU: cuBLAS may pick other kernels for the half batch than for the whole one.
    loss_tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-6)
    param_tol = dict(rtol=2e-2, atol=5e-3) if bf16 else dict(rtol=1e-4, atol=1e-5)
    assert_matches_reference(case, got, ref, WS, dist_cases.STEPS, case.name, loss_tol, param_tol)
    log = got["op_log"]
    n = dist_cases.micro_steps(case)
    reduced = [i for op, g, i, b, dt in log if op == "reduce_grad"]
    assert sorted(set(reduced)) == got["trainable_ids"]
    assert [op for op, *_ in log].count("end_backward") == n
