"""dcplan.shard() of a model built on the meta device, on 2 Gloo ranks: the shards equal a model
built on one rank from the same seed, no rank holds more than one module's parameters at full
size, init= makes buffers, and what cannot be made is refused before anything changes."""
import pytest
import torch

import meta_init_cases as mc
from mp_harness import entry, run_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(dcplan_module):
    return run_ranks(mc.worker, 2)


def test_shards_equal_a_model_built_on_one_rank(run):
    res = entry(run, "from_meta")
    got, ref = res["value"], res["reference"]
    assert sorted(got["params"]) == sorted(n for n in ref["params"])  # the tied head is one parameter
    for name, want in ref["params"].items():
        assert torch.equal(got["params"][name], want), name
    assert torch.equal(got["out"], ref["out"])
    assert got["tied"]
    for rank in range(2):
        held = run[rank]["from_meta"]["value"]["held"]
        assert max(held) == ref["largest_module"], (rank, held)  # one module at full size at a time
    default = entry(run, "default_init")["value"]["params"]
    for name, want in ref["params"].items():
        assert torch.equal(default[name], want), name


def test_init_makes_buffers(run):
    res = entry(run, "with_init")
    assert torch.equal(res["value"]["out"], res["reference"]["out"])


def test_what_cannot_be_made_is_refused(run):
    entry(run, "refusals")  # every rank ran it
    for rank in range(2):
        got = run[rank]["refusals"]["value"]
        assert "buffer 'bias' of module 'pos' (PositionBias) is on the meta device" in got["buffer"]["error"]
        assert "the root module (MetaNet) has parameters on the meta device (scale) and no reset_parameters()" \
            in got["no_reset"]["error"]
        assert "some parameters are on the meta device and others are not" in got["mixed"]["error"]
        assert "init= is for a model built on the meta device" in got["init_on_made"]["error"]
        for case in ("buffer", "no_reset"):
            assert got[case]["still_meta"] and not got[case]["sharded"], case  # nothing changed
