"""dcplan's DCP checkpoints in the original shapes, on 2 Gloo ranks: torch's offline converter and
a plain model read them, FSDP2 loads them, dcplan loads FSDP2's (parameters and optimizer state
equal, bit for bit), the flat layout of older dcplan checkpoints still loads (flat_shards), and
a checkpoint of another model is refused naming the key and both shapes."""
import os
import tempfile

import pytest
import torch

import interop_cases as ic
from mp_harness import entry, run_ranks
from test_checkpoint import assert_equal_states

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(dcplan_module):
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(ic.worker, 2, tmp)
        converted = {}
        for name in ("dcplan", "resaved"):
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            out = os.path.join(tmp, f"{name}.pt")
            dcp_to_torch_save(os.path.join(tmp, name), out)
            converted[name] = torch.load(out, weights_only=False)
        yield results, converted


def value(results, case):
    for rank in range(2):
        entry(results, case)  # raises with the rank's traceback if it failed
    return [results[rank][case]["value"] for rank in range(2)]


def test_converter_gives_the_original_shapes(run):
    """dcp_to_torch_save -> a plain model's load_state_dict(strict=True) -> the trained values."""
    results, converted = run
    saved = value(results, "dcplan_save")[0]["full"]
    ckpt = converted["dcplan"]
    plain = ic.make_net(99)
    plain.load_state_dict(ckpt["model"], strict=True)
    assert_equal_states(dict(plain.state_dict()), saved["model"], "converted model")
    for name, p in plain.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert ckpt["optim"]["state"][name][key].shape == p.shape, f"{name}.{key}"
            assert torch.equal(ckpt["optim"]["state"][name][key], saved["state"][name][key]), f"{name}.{key}"


def test_fsdp2_loads_dcplan(run):
    results, _ = run
    saved = value(results, "dcplan_save")[0]["full"]
    for rank, got in enumerate(value(results, "to_fsdp")):
        assert not torch.equal(got["before"]["model"]["emb.weight"], saved["model"]["emb.weight"])
        assert_equal_states(got["full"], saved, f"FSDP2 rank {rank}")


def test_dcplan_loads_fsdp2(run):
    results, _ = run
    saved = value(results, "fsdp_save")[0]["full"]
    for rank, got in enumerate(value(results, "from_fsdp")):
        assert_equal_states(got["full"], saved, f"dcplan rank {rank}")


def test_flat_checkpoints_still_load(run):
    """A checkpoint in the old flat layout loads with flat_shards=True and saves again in the
    original shapes; loaded without the option, DCP names the size mismatch."""
    results, converted = run
    for rank, got in enumerate(value(results, "flat")):
        assert_equal_states(got["loaded"], got["saved"], f"rank {rank}")
        assert "Size mismatch between saved torch.Size([820]) and current: torch.Size([41, 20])" in \
            got["flat_as_new"], got["flat_as_new"]
    plain = ic.make_net(99)
    plain.load_state_dict(converted["resaved"]["model"], strict=True)
    assert_equal_states(dict(plain.state_dict()), value(results, "flat")[0]["saved"]["model"], "resaved")


def test_other_models_are_refused_by_name(run):
    """Every rank gets the error, naming the key and both shapes (or the missing key)."""
    results, _ = run
    for rank, got in enumerate(value(results, "refusals")):
        assert "Size mismatch between saved torch.Size([41, 20]) and current: torch.Size([43, 20]) for " \
               "model.emb.weight" in got["other_shape"], f"rank {rank}: {got['other_shape']}"
        assert "model.extra.weight" in got["missing_key"], f"rank {rank}: {got['missing_key']}"
        # dcplan's own checks of a DTensor given to set_model_state_dict, before any key is written.
        assert "'head.weight' should be placed [Shard(dim=0)] over the model's 2 ranks, got [Replicate()] " \
               "over 2" in got["replicated"]["error"], got["replicated"]["error"]
        assert f"'head.weight': rank {rank}'s part of the DTensor has 20 elements, expected {420 if rank == 0 else 400}" \
            in got["wrong_part"]["error"], got["wrong_part"]["error"]
        assert got["replicated"]["unchanged"] and got["wrong_part"]["unchanged"]


def test_recipes_group_parameters_as_unsharded(run):
    """Grouping by dimension (nanoGPT, p.ndim, len(p.shape), transformers' Trainer) puts each
    parameter where it goes on the unsharded model: a shard reports its parameter's shape, and
    training with nanoGPT's groups equals the one-process run. Casting the sharded model after
    the fact is refused (it would detach the shards from the runtime)."""
    results, _ = run
    res = entry(results, "grouped")
    got, ref = res["value"], res["reference"]
    assert got["groups"] == ref["groups"]
    assert "emb.weight" in got["groups"]["nanogpt"] and "up.bias" not in got["groups"]["nanogpt"]
    assert "a shard's storage belongs to dcplan's runtime; it cannot become a torch.float64 tensor" in got["cast"]
    # The equivalence matrix's fp32 tolerances (tests/python): 2 ranks sum in another order.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
