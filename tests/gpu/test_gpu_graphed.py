"""dcplan.graphed_step on the GPU: a whole training step (forward, backward, AdamW) of a
sharded model captured in one CUDA graph and replayed, against the same step function called
plainly; eager hooks and compiled replay, ZeRO-1/2/3, gradient accumulation. On 2 GPUs; on a
machine with one, world size 1 (the collectives at one rank, still captured).

Skipped, with the reason, where there is no GPU or dcplan is a CPU build.
"""
import pytest

import graphed_cases as gc
from mp_harness import entry, require_gpus, run_ranks

pytestmark = pytest.mark.gpu

CASES = [("eager", 3, 1), ("eager", 2, 2), ("compiled", 3, 1), ("compiled", 1, 1)]
# Both runs launch the same kernels with the same inputs, in fp32, except where a kernel's
# reduction order is not fixed (atomics in scatter-adds, e.g. the embedding's backward): the GPU
# matrix's tolerances (test_gpu_equivalence.py), not bit equality.
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def results(dcplan_module):
    require_gpus(dcplan_module, 1)
    import torch

    return run_ranks(gc.worker, min(2, torch.cuda.device_count()), CASES, "cuda")


@pytest.mark.parametrize("variant,stage,accum", CASES, ids=[f"{v}-zero{s}-accum{a}" for v, s, a in CASES])
def test_graphed_step_trains_like_the_plain_step(results, variant, stage, accum):
    import torch

    res = entry(results, f"{variant}-zero{stage}-accum{accum}")["value"]
    graphed, plain = res["graphed"], res["plain"]
    # The replays did the step's work: the losses (one per call, the last after close())
    # and the final parameters follow the plain run's.
    torch.testing.assert_close(torch.tensor(graphed["losses"]), torch.tensor(plain["losses"]), **TOL)
    assert graphed["params"].keys() == plain["params"].keys()
    for name in plain["params"]:
        torch.testing.assert_close(graphed["params"][name], plain["params"][name], **TOL, msg=name)
    # ... and the host ran none of the dc ops of a replayed step (the op log saw nothing).
    assert graphed["host_ops"] == []
    # An eager forward while the graph replays the steps is refused, naming the way out.
    assert "captured in a CUDA graph (dcplan.graphed_step)" in graphed["refused"]
    assert "close()" in graphed["refused"]
