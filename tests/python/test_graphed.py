"""dcplan.graphed_step on the host side: its argument checks and its refusals without a GPU.
The capture itself runs on the GPU box (tests/gpu/test_gpu_graphed.py)."""
import pytest
import torch


def test_static_args_copy_a_call_into_the_captured_tensors(dcplan_module):
    from dcplan._graphed import StaticArgs

    x = torch.arange(6.0).view(2, 3)
    static = StaticArgs((x, 3), {"target": torch.zeros(2, dtype=torch.long)})
    (sx, n), kw = static.args()
    assert n == 3 and sx is not x and torch.equal(sx, x)
    addr = sx.data_ptr()
    static.load((x + 1, 3), {"target": torch.ones(2, dtype=torch.long)})
    (sx2, _), kw2 = static.args()
    assert sx2.data_ptr() == addr and torch.equal(sx2, x + 1)  # same memory, new values
    assert torch.equal(kw2["target"], torch.ones(2, dtype=torch.long))


def test_static_args_refuse_what_a_graph_cannot_replay(dcplan_module):
    from dcplan._graphed import StaticArgs

    static = StaticArgs((torch.zeros(2, 3), 3), {})
    with pytest.raises(ValueError, match=r"argument leaf 0 should be a torch.float32 tensor of shape \(2, 3\) on cpu, "
                                         r"as captured \(a CUDA graph has static shapes\), got torch.float32 \(4, 3\)"):
        static.load((torch.zeros(4, 3), 3), {})
    with pytest.raises(ValueError, match=r"argument leaf 0 should be a torch.float32 tensor .* got torch.float64"):
        static.load((torch.zeros(2, 3, dtype=torch.float64), 3), {})
    with pytest.raises(ValueError, match=r"argument leaf 1 is 4, captured as 3: values other than tensors"):
        static.load((torch.zeros(2, 3), 4), {})
    with pytest.raises(ValueError, match=r"argument leaf 1 should be a tensor, as captured, got int"):
        StaticArgs((torch.zeros(1), torch.zeros(1)), {}).load((torch.zeros(1), 1), {})
    with pytest.raises(ValueError, match=r"arguments' structure differs from the captured call's"):
        static.load((torch.zeros(2, 3),), {})


def test_graphed_step_checks_its_arguments(dcplan_module):
    with pytest.raises(ValueError, match=r"warmup should be an int >= 1 .* got 0"):
        dcplan_module.graphed_step(lambda: None, warmup=0)
    with pytest.raises(TypeError, match=r"fn should be callable, got int"):
        dcplan_module.graphed_step(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_graphed_step_needs_a_gpu(dcplan_module):
    calls = []
    step = dcplan_module.graphed_step(lambda: calls.append(1))
    with pytest.raises(RuntimeError, match=r"dcplan.graphed_step: CUDA graphs need a GPU; torch.cuda is not available"):
        step()
    assert calls == [] and not step.captured


def test_optimizer_advice_names_float_learning_rates_and_unfused_adam(dcplan_module):
    """What a capture warns about an optimizer: each param group with a float lr (the graph keeps it)
    and an Adam(W) that is not fused (its capturable per-tensor kernels are slow)."""
    from dcplan._graphed import optimizer_advice

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [a]}, {"params": [b], "lr": torch.tensor(0.01)}]
    advice = optimizer_advice(torch.optim.AdamW(groups, lr=0.1))
    assert len(advice) == 2, advice
    assert advice[0].startswith("AdamW param group 0: lr is the float 0.1, which the captured graph keeps")
    assert "AdamW is not fused" in advice[1] and "fused=True" in advice[1]
    assert optimizer_advice(torch.optim.SGD([{"params": [a], "lr": torch.tensor(0.1)}])) == []


def test_the_capture_watches_each_optimizer_it_steps_once(dcplan_module):
    """The hook a capture installs sees the optimizers the step steps (here on the CPU, without
    a graph), each once, and is gone after close()."""
    from dcplan._graphed import _OptimizerWatch

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.5)
    watch = _OptimizerWatch()
    for _ in range(2):
        p.grad = torch.ones(4)
        opt.step()
    watch.close()
    assert watch.advice == ["SGD param group 0: lr is the float 0.5, which the captured graph keeps; a "
                            "learning-rate schedule must update a tensor in place (lr=torch.tensor(...))"]
    p.grad = torch.ones(4)
    opt.step()  # after close(): not watched
    assert len(watch.advice) == 1
