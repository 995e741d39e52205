"""How an optimizer runs over the shards it steps (dcplan._offload.impl_of, the trace's
params[].optimizer_impl): the planner scales a grouped step's temporaries by it."""
import torch

from dcplan import _offload


def shards(n=2):
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.zeros(4))
        p._dcplan_ds_id = i
        out.append(p)
    return out


def test_an_option_the_user_set_is_what_runs():
    assert _offload.impl_of(torch.optim.AdamW(shards(), fused=True)) == {0: "fused", 1: "fused"}
    assert _offload.impl_of(torch.optim.AdamW(shards(), foreach=True)) == {0: "foreach", 1: "foreach"}
    assert _offload.impl_of(torch.optim.AdamW(shards(), foreach=False)) == {0: "for_loop", 1: "for_loop"}
    # fused=False alone: torch then takes the loop, not its foreach default.
    assert _offload.impl_of(torch.optim.AdamW(shards(), fused=False)) == {0: "for_loop", 1: "for_loop"}
    assert _offload.impl_of(torch.optim.SGD(shards(), lr=0.1, foreach=True)) == {0: "foreach", 1: "foreach"}


def test_torchs_default_is_decided_as_torch_does():
    # CPU tensors have no foreach kernels: the loop (on a GPU, foreach: tests/gpu).
    assert _offload.impl_of(torch.optim.AdamW(shards())) == {0: "for_loop", 1: "for_loop"}


def test_each_param_group_its_own_and_parameters_without_a_ds_id_left_out():
    a, b = shards()
    plain = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": [a, plain], "foreach": True}, {"params": [b], "foreach": False}])
    assert _offload.impl_of(opt) == {0: "foreach", 1: "for_loop"}


def test_an_optimizer_without_those_options_is_not_known():
    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    assert _offload.impl_of(Plain(shards())) == {}
