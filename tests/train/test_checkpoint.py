"""Checkpoints of sharded models: exact resume through torch.distributed.checkpoint with a new
process group, full state dicts into and out of the plain model, and resharding 3 ranks -> 2."""
import os
import tempfile

import pytest
import torch

import checkpoint_cases as cc
from mp_harness import entry, run_ranks

pytestmark = pytest.mark.multiprocess

STAGES = [1, 2, 3]


def assert_equal_states(got, want, what):
    """Exactly equal nested state dicts (tensors bit for bit)."""
    assert type(got) is type(want) or (isinstance(got, (list, tuple)) and isinstance(want, (list, tuple))), \
        f"{what}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            assert_equal_states(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal_states(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} vs {want.shape}"
        assert torch.equal(got, want), f"{what}: values differ (max {(got - want).abs().max().item()})"
    else:
        assert got == want, f"{what}: {got!r} vs {want!r}"


@pytest.fixture(scope="module")
def resumed(dcplan_module):
    return run_ranks(cc.resume_worker, 2, STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_is_exact(resumed, stage):
    """3 steps, DCP save, new process group, new model, DCP load, 3 steps == 6 steps straight."""
    for rank in range(2):
        entry(resumed, f"zero{stage}")  # every rank ran it
        v = resumed[rank][f"zero{stage}"]["value"]
        assert v["first"] == v["straight"][:cc.HALF]
        assert v["second"] == v["straight"][cc.HALF:], f"rank {rank}: losses after resume differ"
        assert_equal_states(v["loaded_full"], v["saved_full"], f"rank {rank} loaded")
        assert_equal_states(v["resumed_full"], v["straight_full"], f"rank {rank} resumed")


@pytest.mark.parametrize("stage", STAGES)
def test_load_is_what_changes_the_model(resumed, stage):
    """The model before the load differs from the checkpoint (so the equality above is the load's)."""
    v = entry(resumed, f"zero{stage}")["value"]
    before, saved = v["before_load"]["model"], v["saved_full"]["model"]
    assert all(not torch.equal(before[k], saved[k]) for k in saved if k.endswith("weight"))
    assert v["before_load"]["optim"]["state"]  # a fresh optimizer's state is made for DCP to load into


@pytest.mark.parametrize("stage", STAGES)
def test_full_state_dict(resumed, stage):
    """Original shapes, loadable into the plain model; back into a sharded one from every rank or
    from rank 0 alone; cpu_offload keeps it on rank 0 only."""
    v = entry(resumed, f"zero{stage}")["value"]
    full = v["saved_full"]["model"]
    plain = cc.make_ckpt_model()
    assert sorted(full) == sorted(plain.state_dict())
    for k, t in plain.state_dict().items():
        assert full[k].shape == t.shape, k
    plain.load_state_dict(v["offloaded"], strict=True)
    for k, t in plain.state_dict().items():
        assert torch.equal(t, full[k]), k
    assert resumed[1][f"zero{stage}"]["value"]["offloaded"] == {}
    assert all(t.device.type == "cpu" for t in v["offloaded"].values())
    assert_equal_states(v["from_full"], v["saved_full"], "loaded from the full state dict")
    assert_equal_states(v["from_rank0"], v["saved_full"], "broadcast from rank 0")
    optim = v["saved_full"]["optim"]
    assert sorted(optim["state"]) == sorted(n for n, p in plain.named_parameters())  # tied: once
    for name, p in plain.named_parameters():
        assert optim["state"][name]["exp_avg"].shape == p.shape, name
    assert full["logit_scale"].shape == () and full["seen"].dtype == torch.int64
    assert full["head.weight"] is full["embed.weight"]  # tied: one tensor under both names
    assert full["seen"].tolist() == [cc.HALF, cc.HALF]


@pytest.mark.parametrize("stage", STAGES)
def test_bad_state_dicts_are_named(resumed, stage):
    for rank in range(2):
        errors = resumed[rank][f"zero{stage}"]["value"]["errors"]
        assert "missing keys ['ln_f.bias']" in errors["missing"]
        assert "unexpected keys ['bogus']" in errors["unexpected"]
        assert errors["lenient"] == "IncompatibleKeys(missing_keys=[], unexpected_keys=['bogus'])"
        assert "'block.attn.proj.weight' should have shape (10, 10) (the model's), got (3, 3)" in errors["shape"]
        assert "'block.attn.proj.weight' should have shape (10, 10)" in errors["shape_broadcast"]
        assert ("param group" in errors["optim_broadcast"]) and (rank == 0 or "found on rank 0" in
                                                                 errors["optim_broadcast"])
        assert "cpu_offload=True needs full_state_dict=True" in errors["offload_sharded"]


@pytest.mark.parametrize("save_stage,load_stage", [(3, 1), (2, 3)], ids=["zero3-to-zero1", "zero2-to-zero3"])
def test_reshard_three_ranks_to_two(dcplan_module, save_stage, load_stage):
    """Saved on 3 ranks, loaded on 2 at another stage: the same model and optimizer state, element
    for element, and training goes on as the single-process run does."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = run_ranks(cc.reshard_save_worker, 3, save_stage, path, label=" (save)")
        loaded = run_ranks(cc.reshard_load_worker, 2, load_stage, path, label=" (load)")
    want = entry(saved, "save")["value"]
    res = entry(loaded, "load")
    got, ref = res["value"], res["reference"]
    assert_equal_states(got["loaded"], want["full"], "loaded on 2 ranks")
    # The equivalence matrix's fp32 tolerances (tests/python): 3 and 2 ranks sum in other orders.
    torch.testing.assert_close(torch.tensor(want["losses"] + got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
