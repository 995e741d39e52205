"""Equivalence matrix: dcplan.shard() on 2 and 3 Gloo ranks against single-process training."""
import pytest
import torch

import dist_cases
from mp_harness import (assert_matches_reference, assert_reduced_grads, entry, run_ranks, selected_cases,
                        skip_unselected)

pytestmark = pytest.mark.multiprocess

CASES = dist_cases.all_cases()


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def dist_results(request, dcplan_module):
    """Spawns one process per rank once per world size; every case runs inside them."""
    ws = request.param
    return ws, run_ranks(dist_cases.worker, ws, selected_cases())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_single_process(dist_results, case):
    ws, per_rank = dist_results
    skip_unselected(case.name)
    res = entry(per_rank, case.name)
    got, ref = res["value"], res["reference"]
    bf16 = case.variant == "bf16"
    loss_tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=0)
    param_tol = dict(rtol=2e-2, atol=5e-3) if bf16 else dict(rtol=1e-5, atol=1e-6)
    assert_matches_reference(case, got, ref, ws, dist_cases.STEPS, f"{case.name} ws={ws}", loss_tol, param_tol)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op_sequence(dist_results, case):
    """The dc ops of one optimizer step, as the runtime saw them: natural order, one gather
    per updated parameter and step for ZeRO-1/2, gradients reduced only for trainable parameters."""
    ws, per_rank = dist_results
    skip_unselected(case.name)
    got = entry(per_rank, case.name)["value"]
    log, (fwd, bwd) = got["op_log"], got["graphs"]
    n = dist_cases.micro_steps(case)
    assert log, "no op recorded"
    gathered = sum(b for op, g, i, b, dt in log if op in ("allgather_param", "prefetch_params_fused"))
    if case.stage in (1, 2):
        # Once per optimizer step, however many micro-steps; frozen parameters never change,
        # so they stay gathered from the first step on.
        assert gathered == got["trainable_gather_bytes"]
    else:
        assert gathered >= n * got["all_gather_bytes"]  # every forward gathers, backward again
    ends = [(op, g) for op, g, i, b, dt in log if op == "end_backward"]
    assert ends == [("end_backward", bwd)] * n
    reduced = [i for op, g, i, b, dt in log if op == "reduce_grad"]
    assert sorted(set(reduced)) == got["trainable_ids"]
    assert not set(reduced) & set(got["frozen_ids"])
    assert all(reduced.count(i) >= n for i in got["trainable_ids"])
    state = {}
    for op, g, i, b, dt in log:
        if g != fwd:
            continue
        if op == "allgather_param":
            state[i] = "gathered"
        elif op == "wait_allgather":
            assert state.get(i) == "gathered", f"wait_allgather of {i} before allgather_param"
            state[i] = "ready"
        elif op == "release_param":
            assert state.get(i) == "ready", f"release_param of {i} before wait_allgather"
            state[i] = "released"
    if case.variant == "bf16":
        assert {dt for op, g, i, b, dt in log if op == "allgather_param"} == {"BFloat16"}


def test_bf16_changes_numerics(dist_results):
    """The bf16 run really computes in bf16: its losses are close to, not equal to, fp32."""
    ws, per_rank = dist_results
    if selected_cases() is not None:
        pytest.skip("needs every case; DCPLAN_TEST_CASES selects some")
    for stage in (1, 2, 3):
        bf = entry(per_rank, f"zero{stage}-bf16")["value"]["losses"]
        fp = entry(per_rank, f"zero{stage}-base")["value"]["losses"]
        assert bf != fp


def test_op_results(dist_results):
    """The CPU kernels on ws ranks: gathers (padded, fused, bf16), release counting, reductions."""
    ws, per_rank = dist_results
    for rank, res in enumerate(per_rank):
        assert "error" not in res["ops"], res["ops"].get("error")
        v = res["ops"]["value"]
        torch.testing.assert_close(v["allgather"], (torch.arange(9.0) + 100).view(3, 3))
        torch.testing.assert_close(v["allgather_bf16"], (torch.arange(14.0) + 300).view(2, 7).bfloat16())
        assert v["held_after_1_of_2"] == [1, 3]
        assert v["held_after_2_of_2"] == []
        assert v["held_after_prefetch"] == [0, 2, 3]
        torch.testing.assert_close(v["fused"][0], torch.arange(5.0))
        torch.testing.assert_close(v["fused"][1], torch.tensor([200.0]))
        torch.testing.assert_close(v["fused"][2], (torch.arange(14.0) + 300).view(2, 7))
        assert v["held_after_clear"] == []
        assert_reduced_grads(v, rank, ws)
        left = [(k, b) for k, b in enumerate(v["z3_left_allocated"]) if b]  # (round, bytes)
        assert len(v["z3_left_allocated"]) == dist_cases.LOAD_ROUNDS and not left, (rank, left)
        # The planner's model of a Gloo gather's scratch, exactly: a bf16 single gather's cast of the
        # scratch parameter's shard; the fused call's fp32 buffer of parameters 0 (5 elements) and 3 (14).
        shard = -(-dist_cases.SCRATCH_ROWS * 256 // ws)
        rounds = dist_cases.GATHER_ROUNDS
        beyond = dict(v["gathers_beyond_copies"])
        gathered = beyond.pop("gathered")
        assert beyond == {"single": [0] * rounds, "single_bf16": [2 * shard] * rounds,
                          "fused": [4 * ws * (-(-5 // ws) + -(-14 // ws))] * rounds}, rank
        numel = dist_cases.SCRATCH_ROWS * 256
        want = torch.arange(ws, dtype=torch.float32).repeat_interleave(shard)[:numel]  # each rank's broadcast
        for dtype, g in gathered.items():
            torch.testing.assert_close(g, want, msg=lambda m, d=dtype: f"rank {rank}, {d}: {m}")
        torch.testing.assert_close(v["fused_two_dtypes"][0], torch.arange(5.0))
        torch.testing.assert_close(v["fused_two_dtypes"][1], (torch.arange(14.0) + 300).view(2, 7).bfloat16())
        torch.testing.assert_close(v["inference_all_reduce_input"], torch.full((4,), float(rank + 1)))
