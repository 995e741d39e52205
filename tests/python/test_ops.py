"""The dc op set on one Gloo rank: opcheck, Meta shapes, CPU semantics, error messages."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

ops = torch.ops.dc if hasattr(torch.ops, "dc") else None


@pytest.fixture(scope="module")
def group(dcplan_module):
    with tempfile.TemporaryDirectory() as tmp:
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        yield dist.group.WORLD
        dcplan_module._C.cleanup()
        if created:
            dist.destroy_process_group()


@pytest.fixture
def C(dcplan_module, group):
    """A fresh runtime with parameters 0 (shape [2, 3], trainable), 1 ([5], frozen) and graph 0 (ZeRO-3)."""
    C = dcplan_module._C
    C.cleanup()
    C.init(group.group_name, reduce_bucket_bytes=64, free_activation_threshold_bytes=1024)
    C.shard0 = torch.arange(6.0)
    C.grad0 = torch.zeros(6)
    C.shard1 = torch.arange(5.0) + 10
    C.register_param(0, [2, 3], C.shard0, C.grad0, False)
    C.register_param(1, [5], C.shard1, None, False)
    C.register_graph_z3(0, [0, 1])
    yield C
    C.cleanup()


def _opcheck(op, args):
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------ opcheck


def test_opcheck_gather_ops(C):
    _opcheck(ops.allgather_param.default, (C.shard0, 0, 0, None))
    _opcheck(ops.allgather_param.default, (C.shard0, 0, 0, torch.bfloat16))
    _opcheck(ops.prefetch_params_fused.default, (0, [C.shard0, C.shard1], [0, 1], None))
    g = ops.allgather_param(C.shard0, 0, 0)
    _opcheck(ops.wait_allgather.default, (g, 0, 0))
    _opcheck(ops.release_param.default, (torch.empty(0), 0, 0, 1))


def test_opcheck_reduce_and_lifecycle_ops(C):
    C.start_backward(True, True)
    _opcheck(ops.reduce_grad.default, (torch.ones(2, 3), 0, 0))
    _opcheck(ops.end_backward.default, (0,))
    _opcheck(ops.free_tensors.default, ([torch.ones(3), torch.ones(2, 2)],))


def test_opcheck_offload_ops(C):
    t = torch.randn(3, 4)
    for op in (ops.offload_tensor, ops.reload_tensor, ops.wait_offload, ops.wait_reload):
        _opcheck(op.default, (t, 0, 7))
    _opcheck(ops.offload_parameter.default, (torch.empty(0), 0, 0))
    _opcheck(ops.reload_parameter.default, (torch.empty(0), 0, 0))


def test_opcheck_inference_all_reduce(C):
    _opcheck(ops.inference_all_reduce.default, (torch.randn(4, 3),))
    _opcheck(ops.inference_all_reduce_.default, (torch.randn(4, 3),))
    _opcheck(ops.inference_all_reduce.default, (torch.randn(3, 4).t(),))


# ------------------------------------------------------------------ Meta


def test_meta_shapes(C):
    m = torch.empty(6, device="meta")
    g = ops.allgather_param(m, 0, 0, torch.bfloat16)
    assert g.device.type == "meta" and g.shape == (2, 3) and g.dtype == torch.bfloat16
    assert ops.allgather_param(m, 0, 0).dtype == torch.float32
    assert ops.wait_allgather(g, 0, 0) is g or ops.wait_allgather(g, 0, 0).shape == g.shape
    assert ops.release_param(g, 0, 0, 1).shape == (2, 3)
    assert ops.reduce_grad(torch.empty(2, 3, device="meta"), 0, 0).shape == (0,)
    x = torch.empty(4, 5, device="meta", dtype=torch.float16)
    for op in (ops.offload_tensor, ops.reload_tensor, ops.wait_offload, ops.wait_reload):
        y = op(x, 0, 1)
        assert y.shape == x.shape and y.dtype == x.dtype and y.device.type == "meta"
    y = ops.inference_all_reduce(x)
    assert y.shape == x.shape and y.dtype == torch.float16
    assert ops.inference_all_reduce_(x) is x
    ops.prefetch_params_fused(0, [m], [0], None)
    assert C.gathered_param_ids() == []  # Meta does no communication


def test_inference_all_reduce_functionalizes(C):
    def f(x):
        y = x * 2
        ops.inference_all_reduce_(y)
        return y + 1

    x = torch.randn(3)
    gm = torch.func.functionalize(f)
    torch.testing.assert_close(gm(x), f(x))
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(torch.func.functionalize(f))(x)
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert ops.inference_all_reduce.default in targets
    assert ops.inference_all_reduce_.default not in targets


# ------------------------------------------------------------------ CPU semantics


def test_gather_returns_full_param_and_release_frees(C):
    g = ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    torch.testing.assert_close(g, torch.arange(6.0).view(2, 3))
    assert C.gathered_param_ids() == [0]
    again = ops.allgather_param(C.shard0, 0, 0)
    assert again.data_ptr() == g.data_ptr()  # held copy reused, no second gather
    ops.release_param(torch.empty(0), 0, 0, 1)
    assert C.gathered_param_ids() == []


def test_persistent_and_profiling(C):
    C.set_persistent(0, True)
    ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    ops.release_param(torch.empty(0), 0, 0, 1)
    assert C.gathered_param_ids() == [0]
    C.invalidate_gathered_param(0)
    assert C.gathered_param_ids() == []
    C.enable_profiling(True)
    assert C.is_profiling()
    ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    ops.release_param(torch.empty(0), 0, 0, 1)
    assert C.gathered_param_ids() == []  # profiling ignores persistence
    C.enable_profiling(False)
    assert not C.is_profiling()


def test_stale_copy_after_shard_update(C):
    C.set_persistent(0, True)
    g = ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    C.shard0.add_(1.0)
    C.invalidate_gathered_param(0)
    g2 = ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    torch.testing.assert_close(g2, torch.arange(6.0).view(2, 3) + 1)
    torch.testing.assert_close(g, torch.arange(6.0).view(2, 3))


def test_reduce_grad_copies_then_accumulates(C):
    C.start_backward(True, True)
    ops.reduce_grad(torch.full((2, 3), 2.0), 0, 0)
    ops.reduce_grad(torch.full((2, 3), 3.0), 0, 0)  # a second use (tied weights) adds
    ops.end_backward(0)
    torch.testing.assert_close(C.grad0, torch.full((6,), 5.0))
    C.start_backward(False, True)  # gradients kept: accumulate
    ops.reduce_grad(torch.ones(2, 3), 0, 0)
    ops.end_backward(0)
    torch.testing.assert_close(C.grad0, torch.full((6,), 6.0))
    C.start_backward(True, True)  # optimizer consumed them: overwrite
    ops.reduce_grad(torch.ones(2, 3), 0, 0)
    ops.end_backward(0)
    torch.testing.assert_close(C.grad0, torch.ones(6))


def test_no_double_buffer(C, group):
    C.cleanup()
    C.init(group.group_name, reduce_bucket_bytes=8, double_buffer=False)
    g = torch.zeros(3)
    C.register_param(0, [3], torch.zeros(3), g, False)
    C.register_param(1, [2], torch.zeros(2), torch.zeros(2), False)
    C.register_graph_z2(0, [0, 1])
    C.start_backward(True, True)
    for k in range(3):  # every gradient overflows the 8-byte bucket: one flush each
        ops.reduce_grad(torch.full((3,), float(k + 1)), 0, 0)
    ops.end_backward(0)
    torch.testing.assert_close(g, torch.full((3,), 6.0))


def test_free_tensors_frees_only_large(C):
    big, small = torch.ones(1024), torch.ones(4)
    ops.free_tensors([big, small])
    assert big.untyped_storage().nbytes() == 0
    assert small.untyped_storage().nbytes() == 16 and small.sum().item() == 4


def test_offload_and_reload(C):
    t = torch.randn(3, 4)
    host = ops.wait_offload(ops.offload_tensor(t, 0, 3), 0, 3)
    back = ops.wait_reload(ops.reload_tensor(host, 0, 3), 0, 3)
    torch.testing.assert_close(back, t)
    assert back.data_ptr() != t.data_ptr()
    ops.offload_parameter(torch.empty(0), 0, 0)
    assert C.shard0.untyped_storage().nbytes() == 0
    ops.reload_parameter(torch.empty(0), 0, 0)
    torch.testing.assert_close(C.shard0, torch.arange(6.0))
    ops.offload_parameter(torch.empty(0), 0, 0)  # a gather reloads on its own
    g = ops.wait_allgather(ops.allgather_param(C.shard0, 0, 0), 0, 0)
    torch.testing.assert_close(g, torch.arange(6.0).view(2, 3))


def test_reset_drops_graphs(C):
    C.reset()
    with pytest.raises(RuntimeError, match="allgather_param: graph_id 0 is not registered"):
        ops.allgather_param(C.shard0, 0, 0)
    C.register_graph_z2(0, [0])  # params stay registered


# ------------------------------------------------------------------ errors


def test_errors_before_init(dcplan_module, group):
    dcplan_module._C.cleanup()
    with pytest.raises(RuntimeError, match="allgather_param: the dc runtime is not initialized"):
        ops.allgather_param(torch.zeros(3), 0, 0)
    with pytest.raises(RuntimeError, match="end_backward: the dc runtime is not initialized"):
        ops.end_backward(0)
    with pytest.raises(RuntimeError, match="register_param: the dc runtime is not initialized"):
        dcplan_module._C.register_param(0, [3], torch.zeros(3), None)


def test_errors_with_ids_and_expectations(C, group):
    with pytest.raises(RuntimeError, match="allgather_param: ds_id 9 is not registered"):
        ops.allgather_param(C.shard0, 0, 9)
    with pytest.raises(RuntimeError, match="reduce_grad: graph_id 4 is not registered"):
        ops.reduce_grad(torch.ones(2, 3), 4, 0)
    with pytest.raises(RuntimeError, match="register_param: ds_id 0 is already registered"):
        C.register_param(0, [2, 3], torch.zeros(6), None)
    with pytest.raises(RuntimeError, match="register_graph: graph_id 0 is already registered"):
        C.register_graph_z1(0, [0])
    with pytest.raises(RuntimeError, match="register_graph: ds_id 7 is not registered"):
        C.register_graph_z1(5, [7])
    with pytest.raises(RuntimeError, match=r"register_param: ds_id 3: ds_tensor should have ceil\(numel/world_size\) = 6"):
        C.register_param(3, [2, 3], torch.zeros(5), None)
    with pytest.raises(RuntimeError, match="register_param: ds_id 3: grad_buffer should be a contiguous 1-D tensor of 6"):
        C.register_param(3, [2, 3], torch.zeros(6), torch.zeros(7))
    with pytest.raises(RuntimeError, match=r"reduce_grad: ds_id 0: gradient should have shape \[2, 3\]"):
        ops.reduce_grad(torch.ones(7), 0, 0)
    with pytest.raises(RuntimeError, match="reduce_grad: ds_id 1 was registered without a gradient buffer"):
        ops.reduce_grad(torch.ones(5), 0, 1)
    with pytest.raises(RuntimeError, match="allgather_param: ds_id 0: the tensor should be the registered shard of 6"):
        ops.allgather_param(torch.zeros(4), 0, 0)
    with pytest.raises(RuntimeError, match="release_param: n_users should be >= 1, got 0"):
        ops.release_param(torch.empty(0), 0, 0, 0)
    with pytest.raises(RuntimeError, match="wait_allgather: ds_id 0 has no gather in flight or held"):
        ops.wait_allgather(torch.empty(0), 0, 0)
    C.register_param(3, [4], torch.zeros(4), None)
    with pytest.raises(RuntimeError, match="allgather_param: ds_id 3 is not a parameter of graph_id 0"):
        ops.allgather_param(torch.zeros(4), 0, 3)
    # A parameter registered with its qualified name is named by it, beside its ds_id.
    with pytest.raises(RuntimeError, match=r"register_param: layers\.0\.w \(ds_id 4\): ds_tensor should have"):
        C.register_param(4, [2, 3], torch.zeros(5), None, name="layers.0.w")
    C.register_param(4, [2, 3], torch.zeros(6), torch.zeros(6), name="layers.0.w")
    C.register_graph_z1(6, [4])
    with pytest.raises(RuntimeError, match=r"reduce_grad: layers\.0\.w \(ds_id 4\): gradient should have shape"):
        ops.reduce_grad(torch.ones(7), 6, 4)
    with pytest.raises(RuntimeError, match="prefetch_params_fused: params and ids should have the same length"):
        ops.prefetch_params_fused(0, [C.shard0], [0, 1], None)
    with pytest.raises(RuntimeError, match="init: the dc runtime is already initialized"):
        C.init(group.group_name)


def test_init_with_unknown_group(dcplan_module, group):
    dcplan_module._C.cleanup()
    with pytest.raises(RuntimeError, match="init: no process group is registered under the name 'nope'"):
        dcplan_module._C.init("nope")


def test_shard_argument_errors(dcplan_module, group):
    dcplan_module.shutdown()
    with pytest.raises(ValueError, match="stage should be 1, 2 or 3, got 4"):
        dcplan_module.shard(nn.Linear(2, 2), stage=4)
    with pytest.raises(ValueError, match="stage should be 1, 2 or 3, got '3'"):
        dcplan_module.shard(nn.Linear(2, 2), stage="3")
    with pytest.raises(ValueError, match="param_dtype should be None or a floating torch.dtype"):
        dcplan_module.shard(nn.Linear(2, 2), param_dtype=torch.int32)
    with pytest.raises(TypeError, match="model should be a torch.nn.Module"):
        dcplan_module.shard(object())
    with pytest.raises(ValueError, match="reduce_bucket_bytes should be a positive int"):
        dcplan_module.shard(nn.Linear(2, 2), reduce_bucket_bytes=0)
    counter = nn.Linear(2, 2)
    counter.steps = nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match="parameter 'steps' should be a floating-point tensor .* got torch.int64"):
        dcplan_module.shard(counter)
    partly_meta = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="some parameters are on the meta device and others are not"):
        dcplan_module.shard(partly_meta)
    with pytest.raises(ValueError, match="init= is for a model built on the meta device"):
        dcplan_module.shard(nn.Linear(2, 2), init=lambda m: None)
    assert not dcplan_module._C.is_initialized(), "a refused shard() starts nothing"
    m = dcplan_module.shard(nn.Linear(2, 2), stage=2)
    with pytest.raises(ValueError, match="model is already sharded"):
        dcplan_module.shard(m)
    with pytest.raises(ValueError, match="requires_gradient_sync should be a bool"):
        m.set_requires_gradient_sync(1)
    dcplan_module.shutdown()


def test_shard_single_rank_trains_like_plain(dcplan_module, group):
    """World size 1: shards are whole parameters and training matches plain PyTorch exactly."""
    dcplan_module.shutdown()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    ref.load_state_dict(model.state_dict())
    dcplan_module.shard(model, stage=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 5)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ropt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    full = dcplan_module.full_parameters(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=0)
    dcplan_module.shutdown()


def test_import_error_names_the_build(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, DCPLAN_BUILD_DIR=str(tmp_path))
    repo_python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    env["PYTHONPATH"] = os.path.abspath(repo_python)
    r = subprocess.run([sys.executable, "-c", "import dcplan"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "the runtime extension dcplan._C is not built" in r.stderr


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage3_frees_gathered_params_after_use(dcplan_module, group, stage):
    """After forward, nothing but a probe holds a ZeRO-3 gathered weight (autograd keeps an id);
    ZeRO-1/2 keep it (the runtime holds it, autograd saved it)."""
    dcplan_module.shutdown()
    m = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    dcplan_module.shard(m, stage=stage)
    caught = []
    m[0].register_forward_hook(lambda mod, a, o: caught.append(mod.weight.untyped_storage()), prepend=True)
    loss = m(torch.randn(3, 16)).square().mean()
    holders = torch._C._storage_Use_Count(caught[0]._cdata) - 1  # minus the probe
    if stage == 3:
        assert holders == 0
        assert dcplan_module._C.gathered_param_ids() == []
    else:
        assert holders >= 2
        assert len(dcplan_module._C.gathered_param_ids()) == 6
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    dcplan_module.shutdown()


@pytest.mark.parametrize("stage", [1, 3])
def test_two_forwards_one_backward_and_kept_grads(dcplan_module, group, stage):
    """Two forwards feeding one backward (pack counts add up), then a second backward without
    zero_grad (gradients accumulate), against plain PyTorch on one rank."""
    dcplan_module.shutdown()
    torch.manual_seed(0)

    def make():
        emb = nn.Embedding(7, 5)
        head = nn.Linear(5, 7, bias=False)
        head.weight = emb.weight
        return nn.ModuleDict({"emb": emb, "mid": nn.Linear(5, 5), "head": head})

    def run(m, idx):
        h = m["mid"](m["mid"](m["emb"](idx)))  # mid called twice
        return m["head"](h).logsumexp(-1).mean()

    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    # ModuleDict has no forward: shard a wrapper whose forward runs the pieces.
    wrapper = nn.Module()
    wrapper.m = model
    wrapper.forward = lambda idx: run(model, idx)
    dcplan_module.shard(wrapper, stage=stage)
    a, b = torch.randint(0, 7, (3, 4)), torch.randint(0, 7, (3, 4))
    (wrapper(a) + wrapper(b)).backward()
    (run(ref, a) + run(ref, b)).backward()
    wrapper(a).backward()
    run(ref, a).backward()
    assert dcplan_module._C.gathered_param_ids() == ([] if stage == 3 else [0, 1, 2])
    shards = {info.name: info for info in wrapper._dcplan.infos}
    for name, p in ref.named_parameters():
        info = shards["m." + name]
        torch.testing.assert_close(info.shard.grad, p.grad.reshape(-1), rtol=1e-6, atol=1e-7)
    dcplan_module.shutdown()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_are_the_callers_alone(dcplan_module, group, stage):
    """Gradients exist from the first reduction of a backward to zero_grad(set_to_none=True):
    the runtime keeps no reference (their memory is freed then, as FSDP2's), and a kept
    gradient is accumulated into in place."""
    import weakref

    dcplan_module.shutdown()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    dcplan_module.shard(m, stage=stage)
    shards = list(m.parameters())
    assert all(p.grad is None for p in shards)  # nothing allocated before a backward
    m(torch.randn(2, 8)).square().mean().backward()
    grads = [p.grad for p in shards]
    assert all(g is not None for g in grads)
    ids = [i.ds_id for i in m._dcplan.infos]
    assert dcplan_module._C.take_grads(ids) == [None] * len(ids)  # handed over at end_backward
    first = [g.clone() for g in grads]
    m(torch.randn(2, 8)).square().mean().backward()  # kept: accumulated into the same tensors
    assert all(p.grad is g for p, g in zip(shards, grads))
    assert any(not torch.equal(g, f) for g, f in zip(grads, first))
    refs = [weakref.ref(g) for g in grads]
    del grads, first
    for p in shards:
        p.grad = None
    assert [r() for r in refs] == [None] * len(refs)
    with pytest.raises(RuntimeError,
                       match=r"set_grads: grads\[0\] for 0\.weight \(ds_id 0\) should be a 1-D floating tensor of"):
        dcplan_module._C.set_grads([0], [torch.zeros(3, 3)])
    dcplan_module.shutdown()


@pytest.mark.parametrize("stage", [1, 3])
def test_hooks_reduce_through_a_cpp_node_and_let_the_model_go(dcplan_module, group, stage):
    """The module hooks are _C.ShardHooks: a gathered parameter's gradient reaches reduce_grad
    through a C++ autograd node (autograd.grad of the shard reaches it too), a sharded model
    and its hooks go with their last reference, and a backward after shutdown() or after its
    model was deleted says why it fails."""
    import gc
    import weakref

    dcplan_module.shutdown()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 3, bias=False))
    dcplan_module.shard(m, stage=stage)
    seen = []
    m[0].register_forward_hook(lambda mod, args, out: seen.append(mod.weight.grad_fn.name()), prepend=True)
    shards = list(m.parameters())
    dcplan_module._C.start_op_log()
    loss = m(torch.randn(2, 8)).square().mean()
    assert seen == ["dcplan::ReduceGradBackward"]
    got = torch.autograd.grad(loss, shards, allow_unused=True)
    assert got == (None, None)  # the shards' gradients are end_backward's to attach, not autograd's
    reduced = [ds for op, _, ds, *_ in dcplan_module._C.take_op_log() if op == "reduce_grad"]
    dcplan_module._C.stop_op_log()
    assert sorted(reduced) == [0, 1]
    assert all(p.grad is not None for p in shards)
    ref = weakref.ref(m)
    hooks = weakref.ref(m._dcplan)
    del m, shards, loss, got
    gc.collect()
    assert ref() is None and hooks() is None
    m = nn.Sequential(nn.Linear(8, 3))
    dcplan_module.shard(m, stage=stage)
    loss = m(torch.randn(2, 8)).sum()
    dcplan_module.shutdown()
    with pytest.raises(RuntimeError, match="runtime is not initialized"):
        loss.backward()
    if stage < 3:  # (ZeRO-3's saved-tensor hooks keep the model's state until backward)
        m = nn.Sequential(nn.Linear(8, 3))
        dcplan_module.shard(m, stage=stage)
        loss = m(torch.randn(2, 8)).sum()
        del m
        gc.collect()
        with pytest.raises(RuntimeError, match="sharded model that has been deleted"):
            loss.backward()
    dcplan_module.shutdown()


def test_check_collectives_setting(monkeypatch, dcplan_module):
    from dcplan import _shard

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("DCPLAN_CHECK_COLLECTIVES", raising=False)
    assert _shard._check_collectives(cpu, 2) and not _shard._check_collectives(gpu, 2)  # auto
    assert not _shard._check_collectives(cpu, 1)  # one rank: no other to disagree with
    # auto while recording: off (the trace's times are the job's), though the replay checks: the trace says so,
    # recorded on one rank too (a plan for more charges the checks; docs/planning.md).
    assert not _shard._check_collectives(cpu, 2, recording=True) and _shard._check_collectives(cpu, 2, recording=False)
    assert _shard._replay_checks_unrecorded(cpu) and not _shard._replay_checks_unrecorded(gpu)
    monkeypatch.setenv("DCPLAN_CHECK_COLLECTIVES", "on")
    assert _shard._check_collectives(gpu, 2) and _shard._check_collectives(cpu, 1)
    assert not _shard._replay_checks_unrecorded(cpu)  # the recording checks too: its times hold them
    monkeypatch.setenv("DCPLAN_CHECK_COLLECTIVES", "OFF")
    assert not _shard._check_collectives(cpu, 2)
    assert not _shard._replay_checks_unrecorded(cpu)
    monkeypatch.setenv("DCPLAN_CHECK_COLLECTIVES", "sometimes")
    with pytest.raises(ValueError, match="DCPLAN_CHECK_COLLECTIVES should be 'auto', 'on' or 'off', got 'sometimes'"):
        _shard._check_collectives(cpu, 2)


def test_init_without_a_model(dcplan_module, group):
    dcplan_module.shutdown()
    dcplan_module.init()
    dcplan_module.init()  # again on the same group: nothing to do
    assert dcplan_module._C.is_initialized()
    x = torch.arange(4.0)
    torch.testing.assert_close(ops.inference_all_reduce(x), x)  # one rank: the sum is x
    m = dcplan_module.shard(nn.Linear(2, 2))  # shard() uses the runtime init() started
    assert m._dcplan is not None
    with pytest.raises(ValueError, match="process_group should be a torch.distributed.ProcessGroup or None"):
        dcplan_module.init("world")
    dcplan_module.shutdown()


def test_nccl_timeout_setting(monkeypatch, dcplan_module):
    from dcplan import _shard

    monkeypatch.delenv("DCPLAN_NCCL_TIMEOUT", raising=False)
    assert _shard._nccl_timeout_s() == 600
    monkeypatch.setenv("DCPLAN_NCCL_TIMEOUT", "2.5")
    assert _shard._nccl_timeout_s() == 2.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv("DCPLAN_NCCL_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"DCPLAN_NCCL_TIMEOUT should be a positive number of seconds, got '{bad}'"):
            _shard._nccl_timeout_s()


def twin_linears(dcplan):
    """A Linear(3, 5) and the same values sharded (ZeRO-3, one rank) on a fresh runtime."""
    dcplan.shutdown()
    torch.manual_seed(0)
    plain = nn.Linear(3, 5)
    sharded = dcplan.shard(nn.Linear(3, 5).requires_grad_(True), stage=3)
    with torch.no_grad():
        for p, s in zip(plain.parameters(), sharded.parameters()):
            s.copy_(p.reshape(-1))
    return plain, sharded


def test_clipping_inside_a_fused_adamw_step_trains_as_clipping_the_gradients(dcplan_module, group):
    """clip_grad_norm_(..., optimizer=opt): the fused AdamW applies the scale as it reads the
    gradients (grad_scale); the parameters follow torch's clipping of the unsharded model and a
    plain fused AdamW, step for step, and a step after one without clipping is not scaled."""
    plain, sharded = twin_linears(dcplan_module)
    want_opt = torch.optim.AdamW(plain.parameters(), lr=0.1, fused=True)
    got_opt = torch.optim.AdamW(sharded.parameters(), lr=0.1, fused=True)
    for step in range(4):
        x = torch.randn(4, 3)
        for model, opt in ((plain, want_opt), (sharded, got_opt)):
            model(x).square().sum().backward()
            if step != 2:  # the third step is not clipped: no scale is left over from the second
                if model is plain:
                    want = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5)
                else:
                    got = dcplan_module.clip_grad_norm_(sharded, 0.5, optimizer=got_opt)
            opt.step()
            opt.zero_grad()
        if step != 2:
            torch.testing.assert_close(got, want)
        assert want > 0.5  # every clipped step clips
        assert getattr(got_opt, "grad_scale", None) is None
        for p, s in zip(plain.parameters(), sharded.parameters()):
            torch.testing.assert_close(s.detach(), p.detach().reshape(-1))


def test_clip_grad_norm_on_one_rank_and_the_warning_for_torchs(dcplan_module, group):
    import warnings

    plain, sharded = twin_linears(dcplan_module)
    x = torch.randn(4, 3)
    plain(x).square().sum().backward()
    sharded(x).square().sum().backward()
    for norm_type in (2.0, float("inf")):
        want = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 1e9, norm_type)
        got = dcplan_module.clip_grad_norm_(sharded, 1e9, norm_type)  # max_norm that clips nothing
        torch.testing.assert_close(got, want)
    want = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5)
    got = dcplan_module.clip_grad_norm_(sharded, 0.5)
    torch.testing.assert_close(got, want)
    for p, s in zip(plain.parameters(), sharded.parameters()):
        torch.testing.assert_close(s.grad, p.grad.reshape(-1))  # clipped alike
    # Nothing is read back to the host (what makes it capturable in a CUDA graph; tests/gpu checks
    # the stream's side): no item(), tolist() or truth test of a tensor.
    def read_back(*args, **kwargs):
        raise AssertionError("clip_grad_norm_ read a tensor on the host")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__bool__"):
            mp.setattr(torch.Tensor, name, read_back)
        dcplan_module.clip_grad_norm_(sharded, 0.5)
    with pytest.warns(UserWarning, match="clips each rank by the norm of its own shards"):
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)  # once only
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # not shards: silent
    with pytest.raises(ValueError, match="model is not sharded by dcplan.shard"):
        dcplan_module.clip_grad_norm_(plain, 1.0)
    with pytest.raises(ValueError, match=r"optimizer= needs a fused Adam or AdamW \(fused=True\).*got SGD"):
        dcplan_module.clip_grad_norm_(sharded, 1.0, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.1))
    # Other parameters in the optimizer, a scale no step used, a scale replaced before the step.
    other = torch.optim.AdamW([*sharded.parameters(), nn.Parameter(torch.zeros(2))], fused=True)
    with pytest.raises(ValueError, match="steps parameters that are not this model's trainable shards"):
        dcplan_module.clip_grad_norm_(sharded, 1.0, optimizer=other)
    opt = torch.optim.AdamW(sharded.parameters(), fused=True)
    dcplan_module.clip_grad_norm_(sharded, 0.5, optimizer=opt)
    with pytest.raises(ValueError, match="still holds the scale of an earlier clip_grad_norm_ that no step has used"):
        dcplan_module.clip_grad_norm_(sharded, 0.5, optimizer=opt)
    opt.grad_scale = torch.ones(())  # as a GradScaler's step() sets its own
    with pytest.raises(RuntimeError, match=r"grad_scale was replaced before its step \(a GradScaler steps it\?\)"):
        opt.step()
    with pytest.raises(ValueError, match="norm_type should be > 0 or inf, got -1.0"):
        dcplan_module.clip_grad_norm_(sharded, 1.0, norm_type=-1)
    dcplan_module.shutdown()


# ------------------------------------------------------------------ CUDA graph capture (dcplan.graphed_step)


def test_capture_is_refused_on_a_host_transport(C):
    with pytest.raises(RuntimeError, match=r"begin_capture: a CUDA graph captures only work queued on a GPU "
                                           r"\(the NCCL transport\); this runtime uses the gloo transport"):
        C.begin_capture()
    # Refused before anything changed: eager steps still run, and there is nothing to end.
    C.start_forward()
    with pytest.raises(RuntimeError, match=r"end_capture: no capture under way \(begin_capture first\)"):
        C.end_capture()
    C.release_capture()  # nothing captured: a no-op


def test_capture_is_refused_while_ops_are_observed(C):
    C.start_op_log()
    try:
        with pytest.raises(RuntimeError, match=r"begin_capture: an op observer is set .*record or log without "
                                               r"dcplan.graphed_step"):
            C.begin_capture()
    finally:
        C.stop_op_log()


def test_a_plan_is_refused_by_the_other_kind_of_replay(dcplan_module, monkeypatch):
    """A plan made for one CUDA graph per step and a plan for the hooks: each refused by the other
    replay (the wiring is tested end to end by test_record_e2e and tests/gpu)."""
    from dcplan import _plan

    graph = ("graph.json", True)
    monkeypatch.setattr(_plan, "_loaded", graph)
    with pytest.raises(ValueError, match="plan graph.json was made for one CUDA graph per step"):
        _plan.check_forward(graph)
    _plan.check_forward(None)  # another model, sharded without a plan
    with torch.no_grad():
        _plan.check_forward(graph)  # a forward without grad passes the plan check
    with _plan.graphed_call():
        _plan.check_forward(graph)  # the warm-up and captured runs of dcplan.graphed_step
        _plan.check_graphed_plan()
    monkeypatch.setattr(_plan, "_loaded", ("hooks.json", False))
    _plan.check_forward(("hooks.json", False))
    with pytest.raises(ValueError, match="plan hooks.json was made for a replay by the host .* captured in one "
                                         "CUDA graph; plan with dcplan plan --cuda-graph"):
        _plan.check_graphed_plan()
    _plan.forget()
    assert _plan._loaded is None


def test_shards_take_torchs_foreach_and_fused_optimizers(dcplan_module):
    """torch's optimizers default to their foreach/fused kernels only for the parameter types it
    lists; a ShardParameter must be one, or a default AdamW over GPU shards loops per tensor."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    assert dcplan_module.ShardParameter in optimizer._foreach_supported_types
    assert dcplan_module.ShardParameter in _foreach_utils._foreach_supported_types
