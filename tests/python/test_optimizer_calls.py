"""How an optimizer runs over the shards it steps (dcplan._optimizer_calls, the trace's
params[].optimizer_impl and optimizer_group): the planner scales a grouped step's temporaries by
them. Torch's own choice is what its step really calls, seen by replacing its implementations."""
import pytest
import torch
from torch.optim import adam, sgd

from dcplan import _optimizer_calls


def shards(n=2):
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(4))
        p._dcplan_ds_id = i
        out.append(p)
    return out


def impls(optimizer):
    return _optimizer_calls.CallRecorder().of(optimizer)[0]


def test_an_option_the_user_set_is_what_runs():
    assert impls(torch.optim.AdamW(shards(), fused=True)) == {0: "fused", 1: "fused"}
    assert impls(torch.optim.AdamW(shards(), foreach=True)) == {0: "foreach", 1: "foreach"}
    assert impls(torch.optim.AdamW(shards(), foreach=False)) == {0: "for_loop", 1: "for_loop"}
    assert impls(torch.optim.SGD(shards(), lr=0.1, foreach=True)) == {0: "foreach", 1: "foreach"}


def ran(optimizer, monkeypatch, module, names):
    """Which of module's implementations optimizer.step() calls (each replaced by a spy that only
    notes the call: a capturable step would not run on CPU tensors)."""
    seen = []
    for name in names:
        monkeypatch.setattr(module, name, lambda *args, _name=name, **kwargs: seen.append(_name))
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return seen


ADAM = {"_single_tensor_adam": "for_loop", "_multi_tensor_adam": "foreach"}
SGD = {"_single_tensor_sgd": "for_loop", "_multi_tensor_sgd": "foreach"}


@pytest.mark.parametrize("foreach_on_cpu", [False, True])
@pytest.mark.parametrize("make, module, names", [
    (lambda ps: torch.optim.AdamW(ps), adam, ADAM),
    (lambda ps: torch.optim.Adam(ps, fused=False), adam, ADAM),  # fused=False alone: torch's loop
    (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01)), adam, ADAM),  # a tensor lr: no foreach
    (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01), capturable=True), adam, ADAM),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), sgd, SGD),
], ids=["adamw", "adam-fused-false", "tensor-lr", "tensor-lr-capturable", "sgd"])
def test_torchs_own_choice_is_what_is_recorded(make, module, names, foreach_on_cpu, monkeypatch):
    """On CPU tensors torch takes its loop; with foreach kernels said to exist for CPU (as for a
    GPU's), foreach where the rules allow it."""
    if foreach_on_cpu:
        from torch.optim import optimizer as optim_module

        monkeypatch.setattr(optim_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu", "cuda"])
    optimizer = make(shards())
    recorded = impls(optimizer)
    seen = ran(optimizer, monkeypatch, module, names)
    assert len(seen) == 1, seen
    assert recorded == {0: names[seen[0]], 1: names[seen[0]]}


def test_other_optimizers_left_open_are_not_known():
    assert impls(torch.optim.Adafactor(shards())) == {}  # it runs its loop where torch's Adam would not

    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    assert impls(Plain(shards())) == {}


def test_param_groups_are_numbered_over_the_recorded_optimizers_in_the_order_first_stepped():
    a, b, c = shards(3)
    plain = torch.nn.Parameter(torch.zeros(3))
    first = torch.optim.AdamW([{"params": [a, plain], "foreach": True}, {"params": [b], "foreach": False}])
    second = torch.optim.SGD([c], lr=0.1, foreach=True)
    calls = _optimizer_calls.CallRecorder()
    assert calls.of(second) == ({2: "foreach"}, {2: 0})
    assert calls.of(first) == ({0: "foreach", 1: "for_loop"}, {0: 1, 1: 2})
    assert calls.of(second)[1] == {2: 0}  # the same numbers at every step


def test_a_grouped_step_calls_torch_once_per_offload_call_and_param_group(monkeypatch):
    """What the planner's scratchShare assumes of the runtime (python/dcplan/_offload.py): the
    parameters kept on the device in one step() first, then one per offload group, and torch's
    foreach AdamW splits each by param group."""
    import types

    from dcplan import _offload

    a, b, c, d = shards(4)
    opt = torch.optim.AdamW([{"params": [a, b]}, {"params": [c, d]}], foreach=True)
    infos = [types.SimpleNamespace(ds_id=p._dcplan_ds_id, shard=p) for p in (a, b, c, d)]
    calls = []
    real = adam._multi_tensor_adam

    def spy(params, *args, **kwargs):
        calls.append([p._dcplan_ds_id for p in params])
        return real(params, *args, **kwargs)

    monkeypatch.setattr(adam, "_multi_tensor_adam", spy)
    _offload.register(infos, [[1, 2]], [])  # one offload group across both param groups
    try:
        for p in (a, b, c, d):
            p.grad = torch.ones_like(p)
        opt.step()
    finally:
        _offload.forget()
    # Then the optimizer's own step() over the groups the hook emptied: calls over nothing.
    assert calls == [[0], [3], [1], [2], [], []], calls

