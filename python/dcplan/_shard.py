"""dcplan.shard(): partitions a model's parameters and issues the dc ops from module hooks.

The hooks only issue the natural op sequence; every scheduling decision
(what stays gathered, when buckets flush, what is prefetched) is the C++
executor's. Per model:

* forward, per module owning parameters: ``allgather_param`` (several
  parameters: one ``prefetch_params_fused`` first) and ``wait_allgather`` in a
  forward pre-hook, ``release_param`` in the forward hook;
* backward: a gathered parameter that autograd saved is packed as its id
  (``saved_tensors_hooks``) and gathered again when backward unpacks it (ZeRO-3
  only; ZeRO-1/2 keep parameters gathered); each gradient goes to
  ``reduce_grad``; an autograd end-of-backward callback runs ``end_backward``
  and attaches the reduced shard gradients as ``.grad`` of the shards.

The per-parameter work (the ops, the gathered parameters' autograd nodes, the
saved-tensor bookkeeping) is ``_C.ShardHooks``': one C++ call per module hook, so
that the host issues a step about as fast as the GPU runs it.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _plan
from . import _C, _activations, _class_swap, _compile, _graphed, _host_memory, _meta_init, _offload, _record, _shm
from ._shard_param import ShardParameter

_DEFAULT_BUCKET_BYTES = _C.DEFAULT_BUCKET_BYTES  # the runtime's own default (schemas::kDefaultBucketBytes)
_EXIT_GRACE_S = 0.05  # at exit, time for Gloo's worker threads to drop what they hold (_cleanup_at_exit)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# One runtime per process; ids are unique across every sharded model in it.
_runtime_group: Optional[str] = None
_runtime_started = False  # whether this process ever ran the runtime (the exit handler's grace period)
_next_ds_id = 0
_next_graph_id = 0


@dataclasses.dataclass(eq=False)
class _ParamInfo:
    ds_id: int
    name: str
    shape: torch.Size
    numel: int
    shard: nn.Parameter  # what the optimizer sees: this rank's flat fp32 slice

    @property
    def trainable(self) -> bool:
        return self.shard.requires_grad


@dataclasses.dataclass(frozen=True)
class _Packed:
    """A saved gathered parameter, kept as its id and view geometry."""

    ds_id: int
    size: torch.Size
    stride: tuple
    offset: int


class _ShardState:
    """Per-model runtime state behind the hooks; the per-parameter work is _C.ShardHooks'."""

    def __init__(self, stage, pg, param_dtype, fwd_graph, bwd_graph, compiled: bool = False):
        self.stage = stage
        # No reference to pg: dist.destroy_process_group() must be able to free it (and join
        # Gloo's worker threads) while Python is alive, not when the model is collected at exit.
        self.world_size = pg.size()
        self.group_name = pg.group_name  # the state-dict functions find the group by its name
        self.param_dtype = param_dtype
        self.fwd_graph = fwd_graph
        self.bwd_graph = bwd_graph
        self.infos: List[_ParamInfo] = []
        self.forward_depth = 0
        self.saved_hooks = None
        self.saved: Optional[_activations.Forward] = None  # counts this forward's saves while recording
        self.activation_trial: Optional[_activations.Trial] = None  # the recorder's trial forward found
        self.trial_started = False
        self.offload_slots: Optional[_activations.HostSlots] = None  # the plan's saves' host memory
        self.record_paused = False  # this forward (no grad) is not recorded as a micro-step
        self.plan: Optional[tuple] = None  # (path, made for one CUDA graph) of the plan it follows
        self.plan_inputs = None  # _plan.PlannedInputs: the input shapes the plan's recording ran
        self.inputs_warned = False  # a forward's inputs differed from plan_inputs (InputShapeWarning)
        self.outside: Dict[tuple, torch.Tensor] = {}  # this forward's reads outside the owning module
        self.trainable_infos: List[_ParamInfo] = []
        self.trainable_ids: List[int] = []
        self.compiled = compiled  # model.forward runs as torch.compile graphs (_compile)
        self.eager_read_warned = False  # compiled: a parameter read outside the graphs was reported
        self.hooks = _C.ShardHooks(stage, fwd_graph, bwd_graph, param_dtype, _weak_begin_backward(self))

    @property
    def requires_sync(self) -> bool:
        return self.hooks.requires_sync

    @requires_sync.setter
    def requires_sync(self, value: bool) -> None:
        self.hooks.requires_sync = value

    def recomputing(self) -> bool:
        """Whether a module runs forward again inside backward (activation checkpointing):
        outside the model's own forward, on the autograd engine's backward."""
        return self.forward_depth == 0 and torch._C._current_graph_task_id() != -1

    def read_outside(self, ds_id: int, recompute: bool) -> torch.Tensor:
        """A parameter read outside its module's forward (_reader_body): gathered once per forward
        and grad mode (a copy gathered under no_grad has no gradient path); in a recomputation
        (activation checkpointing), on the backward graph at each read."""
        key = (ds_id, torch.is_grad_enabled())
        full = None if recompute else self.outside.get(key)
        if full is None:
            [full] = self.hooks.forward_gather([ds_id], recompute)
            self.hooks.forward_release([ds_id], recompute)
            if not recompute:
                self.outside[key] = full
        return full

    # -- saved tensors (ZeRO-3) -------------------------------------------
    def pack(self, t: torch.Tensor):
        ds_id = self.hooks.pack(t)
        if ds_id >= 0:
            return _Packed(ds_id, t.size(), t.stride(), t.storage_offset())
        return t if self.saved is None else self.saved.pack(t)

    def unpack(self, x):
        if not isinstance(x, _Packed):
            return _activations.unpack(x)
        return self.hooks.unpack(x.ds_id, x.size, x.stride, x.offset)

    def begin_saves(self) -> None:
        """At a training forward's start: what takes its saves. While recording, what counts them
        (the recorder's trial in the first warm-up step's first forward, a recorded micro-step's
        count); with a plan that offloads some, what moves those; else nothing."""
        if not torch.is_grad_enabled():
            return  # saves nothing: what an earlier forward's backward reads stays as it is
        self.saved = None
        if _record.active():
            if not _activations.recording_enabled():
                return
            trial = _C.record_warmup_step() == 0 and not self.trial_started
            if trial or _C.record_position(self.fwd_graph) >= 0:
                self.trial_started |= trial
                self.saved = _activations.Forward(self.fwd_graph, self.bwd_graph, _plan.runtime_device, trial)
        elif self.offload_slots is not None:
            self.saved = self.offload_slots.forward(self.fwd_graph, self.bwd_graph, _plan.runtime_device)

    def report_saves(self) -> None:
        """At the backward's end: the trial's findings kept, a recorded micro-step's saves recorded."""
        saved, self.saved = self.saved, None
        if saved is None:
            return
        if saved.trial:
            self.activation_trial = _record.own_work(saved.findings)
        elif saved.slots is None and _record.active():
            _record.own_work(self._record_saves, saved)

    def _record_saves(self, saved: _activations.Forward) -> None:
        _record.saved_activations(self.fwd_graph, saved.report(self.activation_trial))

    # -- backward ----------------------------------------------------------
    def begin_backward(self) -> None:
        """Before a backward's first op (called by the hooks): its positions count from here."""
        # Reductions add to the gradients the shards hold; a shard without one gets it from its
        # first reduction (the runtime keeps no gradient memory between steps, as FSDP2).
        _C.set_grads(self.trainable_ids, [i.shard.grad for i in self.trainable_infos])
        _C.start_backward(False, self.requires_sync)
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        self.hooks.in_backward = False
        torch.ops.dc.end_backward(self.bwd_graph)
        _plan.warn_departure()
        for i, grad in zip(self.trainable_infos, _C.take_grads(self.trainable_ids)):
            if grad is not None and grad is not i.shard.grad:
                i.shard.grad = grad
        if self.stage == 3:
            self.hooks.after_backward()
            self.report_saves()


def _weak_begin_backward(state: "_ShardState"):
    """state.begin_backward without a reference to state (the C++ hooks that call it are state's)."""
    method = weakref.WeakMethod(state.begin_backward)

    def begin_backward() -> None:
        bound = method()
        if bound is None:
            raise RuntimeError("dcplan: backward began for a sharded model that has been deleted")
        bound()

    return begin_backward


def _check_args(model, stage, process_group, param_dtype, reduce_dtype, reduce_bucket_bytes):
    if not isinstance(model, nn.Module):
        raise TypeError(f"dcplan.shard: model should be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"dcplan.shard: stage should be 1, 2 or 3, got {stage!r}")
    for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and dt not in _FLOAT_DTYPES:
            raise ValueError(f"dcplan.shard: {name} should be None or a floating torch.dtype, got {dt!r}")
    if not isinstance(reduce_bucket_bytes, int) or reduce_bucket_bytes <= 0:
        raise ValueError(f"dcplan.shard: reduce_bucket_bytes should be a positive int, got {reduce_bucket_bytes!r}")
    if getattr(model, "_dcplan", None) is not None:
        raise ValueError("dcplan.shard: model is already sharded")
    _check_group("dcplan.shard", process_group)
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ValueError(
                f"dcplan.shard: parameter '{name}' should be a floating-point tensor (shards are fp32 master "
                f"copies), got {p.dtype}; keep it as a buffer (register_buffer) instead"
            )


def _check_group(caller: str, process_group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{caller}: torch.distributed is not initialized; call dist.init_process_group() first")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"{caller}: process_group should be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}"
        )


def shard(
    model: nn.Module,
    stage: int = 3,
    process_group: Optional[dist.ProcessGroup] = None,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    *,
    reduce_bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
    plan=None,
    record=None,
    on_mismatch: str = "error",
    compile=False,
    device=None,
    init=None,
) -> nn.Module:
    """Shards model's parameters over process_group (default: the world) for ZeRO stage 1, 2 or 3.

    Afterwards ``model.parameters()`` yields this rank's flat fp32 shards (zero
    padded to ceil(numel/world_size)); build the optimizer on them. Gradients
    are averaged over ranks. ``param_dtype``: dtype parameters are gathered and
    computed in; ``reduce_dtype``: dtype gradients are reduced in (default:
    param_dtype). ``reduce_bucket_bytes``: reduce bucket size in bytes (used by
    the first shard() of the process, which starts the runtime). Use
    ``model.set_requires_gradient_sync(False)`` on the micro-steps before a
    gradient-accumulation boundary. Modifies and returns model.

    ``plan``: a plan file (``dcplan plan``; default ``$DCPLAN_PLAN``) whose prefetches,
    persistent parameters and buckets the runtime follows. It is checked against this
    model, world size, stage and dtypes here (ValueError saying what differs).
    ``on_mismatch``: what a departure from the plan does: ``"error"`` raises at the op
    where it happens, ``"fallback"`` warns once (PlanDepartureWarning) and continues
    with the default schedule; the numbers are the same either way.
    ``$DCPLAN_REPLAY_LOG``: write each rank's replay log (see ``dcplan.replay_log``).
    ``record``: a directory to record a trace into (docs/recording.md); None:
    ``$DCPLAN_RECORD`` decides; False: off.
    ``compile``: True, or a dict of ``torch.compile`` arguments (``fullgraph``, ``dynamic``,
    ``options``): ``model.forward`` runs as torch.compile graphs with the dc ops inside them, and
    its backward as the graph AOTAutograd derives (docs/compiled.md).
    A model built on the meta device (``with torch.device("meta")``) is made one module at a
    time on ``device`` (default: the current CUDA device, else the CPU), initialised by
    ``init(module)`` (default: the module's ``reset_parameters()``), and only this rank's shard
    kept (docs/runtime.md).
    """
    global _next_graph_id
    _check_args(model, stage, process_group, param_dtype, reduce_dtype, reduce_bucket_bytes)
    meta_device = _meta_init.check(model, device, init)
    _compile.check_settings(compile)
    plan_path = _plan.resolve_plan(plan)
    _plan.check_on_mismatch(on_mismatch)
    recording = _record.settings(record)
    if recording is not None and plan_path is not None:
        raise ValueError(
            "dcplan.shard: a trace is recorded gather-on-use, without a plan; drop plan= / DCPLAN_PLAN, "
            "or recording (record= / DCPLAN_RECORD)"
        )
    pg = process_group if process_group is not None else dist.group.WORLD
    _start_runtime(meta_device or _param_device(model), pg, recording, reduce_bucket_bytes)
    if plan_path is not None:
        _plan.count_cpu_memory(_plan.runtime_device)  # before the shards: the budget guard reads it
    if reduce_dtype is None:
        reduce_dtype = param_dtype
    fwd_graph, bwd_graph = _next_graph_id, _next_graph_id + 1
    _next_graph_id += 2
    state = _ShardState(stage, pg, param_dtype, fwd_graph, bwd_graph, compiled=compile is not False)
    owned = _shard_parameters(model, state, pg.size(), pg.rank(), meta_device, init)
    _register_graphs(state, reduce_dtype)
    if plan_path is not None:
        loaded = _plan.load(state, plan_path, on_mismatch, reduce_dtype)
        state.hooks.set_keep(loaded["persistent"])
        saves, saves_field = loaded["offload_saves"], loaded["offload_saves_pointer"]
        saves_bytes = _activations.HostSlots.host_bytes(saves) if saves else 0
        _host_memory.check(plan_path, loaded["offload_state_bytes"], loaded["offload_master_bytes"],
                           _plan.runtime_device, pg, saves_bytes, saves_field)
        groups, group_bytes = loaded["optimizer_offload"], loaded["optimizer_offload_bytes"]

        def allocate():
            pools = _offload.allocate(state.infos, groups, group_bytes, loaded["master_offload"], str(plan_path))
            slots = _activations.HostSlots(str(plan_path), saves_field, saves, _plan.runtime_device) if saves else None
            return pools, slots

        pools, state.offload_slots = _host_memory.allocate(
            plan_path, _offload.host_bytes(groups, group_bytes), loaded["offload_master_bytes"],
            _plan.runtime_device, pg, allocate, saves_bytes, saves_field)
        _offload.register(state.infos, groups, loaded["master_offload"], pools)
    if _record.active():
        _record.add_model(stage, fwd_graph, bwd_graph, state.infos, pg.size(), param_dtype, reduce_dtype,
                          state.compiled)
    _install_hooks(model, state, owned, compile)
    model._dcplan = state
    model.set_requires_gradient_sync = _gradient_sync_setter(weakref.ref(model))
    return model


def _start_runtime(device: torch.device, pg: dist.ProcessGroup, recording, reduce_bucket_bytes: int) -> None:
    """Starts the runtime on pg at the process's first shard() (arming the recorder first where
    recording); later calls must use the same group."""
    global _runtime_group
    group_name = pg.group_name
    if _runtime_group is None or not _C.is_initialized():
        if recording is not None and not _record.active():
            _record.begin(recording, device)  # before init: the recorder times its transport
        _plan.forget()  # a new runtime follows no plan yet
        _init_runtime(pg, device, reduce_bucket_bytes)
        _runtime_group = group_name
        _plan.runtime_device = device
        _plan.start_env_replay_log(pg.rank())
        if _record.active():
            _record.attach()
            if _replay_checks_unrecorded(device):
                _record.mark_checks_collectives()
    elif recording is not None and not _record.active():
        raise ValueError("dcplan.shard: recording must be switched on at the first dcplan.shard() of the process")
    elif _runtime_group != group_name:
        raise ValueError(
            f"dcplan.shard: the runtime runs on process group '{_runtime_group}', got '{group_name}'; "
            "call dcplan.shutdown() first"
        )


_Owned = Dict[int, Tuple[nn.Module, List[str], List[int]]]  # id(module) -> (module, attrs, ds_ids)


def _shard_parameters(model: nn.Module, state: _ShardState, world_size: int, rank: int,
                      meta_device: Optional[torch.device], init) -> _Owned:
    """Replaces every parameter by this rank's flat shard, registered with the runtime (a tied
    parameter once); returns each module's sharded attributes. A meta-device model's modules are
    made (_meta_init) one at a time, just before their parameters are sharded."""
    global _next_ds_id
    by_param: Dict[int, _ParamInfo] = {}  # id(parameter) -> its shard; a made one by its meta original's
    replaced_meta: List[nn.Parameter] = []  # alive until the end: by_param's ids stay theirs
    owned: _Owned = {}
    for mod_name, module in model.named_modules():
        replaced = _meta_init.materialize(module, meta_device, init, by_param) if meta_device else {}
        replaced_meta.extend(replaced.values())
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            info = by_param.get(id(p))
            if info is None:
                info = _make_shard(p, f"{mod_name}.{attr}" if mod_name else attr, _next_ds_id, world_size, rank)
                _next_ds_id += 1
                _C.register_param(info.ds_id, list(info.shape), info.shard.detach(), None, state.stage < 3,
                                  trainable=info.trainable, name=info.name)
                # Keyed by an object that stays alive, so that no id is reused: a made parameter is
                # freed once sharded, and a later module tied to it holds its meta original.
                by_param[id(replaced[attr]) if attr in replaced else id(p)] = info
                state.infos.append(info)
                state.hooks.add_param(info.ds_id, info.shard)
            module._parameters[attr] = info.shard
            _, attrs, ids_of_module = owned.setdefault(id(module), (module, [], []))
            attrs.append(attr)
            ids_of_module.append(info.ds_id)
        p = None  # a made parameter must not outlive its module's turn (the next module is made next)
    state.trainable_infos = [i for i in state.infos if i.trainable]
    state.trainable_ids = [i.ds_id for i in state.trainable_infos]
    return owned


def _register_graphs(state: _ShardState, reduce_dtype: Optional[torch.dtype]) -> None:
    ids = [i.ds_id for i in state.infos]
    register = {1: _C.register_graph_z1, 2: _C.register_graph_z2, 3: _C.register_graph_z3}[state.stage]
    register(state.fwd_graph, ids)
    register(state.bwd_graph, ids, reduce_dtype)


def _install_hooks(model: nn.Module, state: _ShardState, owned: _Owned, compile) -> None:
    """Per module: the eager gather/release hooks, or the compiled replay's properties; the
    root's step hooks; the compiled forward."""
    for module, attrs, ids_of_module in owned.values():
        if state.compiled:
            _compile.install(state, module, attrs, ids_of_module)
            continue
        _watch_outside_reads(state, module, attrs, ids_of_module)
        module.register_forward_pre_hook(_make_pre_hook(state, attrs, ids_of_module))
        module.register_forward_hook(_make_post_hook(state, attrs, ids_of_module), always_call=True)
    model.register_forward_pre_hook(_make_root_pre_hook(state), prepend=True, with_kwargs=True)
    model.register_forward_hook(_make_root_post_hook(state), always_call=True)
    if state.compiled:
        _compile.compile_forward(model, compile)


def _gradient_sync_setter(model_ref):
    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False on the micro-steps before a gradient-accumulation boundary (ZeRO-1 defers its reduction).

        recurse is accepted for FSDP2 compatibility; the setting always covers the whole model.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(
                f"set_requires_gradient_sync: requires_gradient_sync should be a bool, got {requires_gradient_sync!r}"
            )
        m = model_ref()
        if m is not None:
            m._dcplan.requires_sync = requires_gradient_sync

    return set_requires_gradient_sync


def _param_device(model: nn.Module) -> torch.device:
    """The one device of model's parameters (CPU for a model without any)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"dcplan.shard: the parameters should be on one device, got {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def _init_runtime(pg: dist.ProcessGroup, device: torch.device, reduce_bucket_bytes: int,
                  check_collectives: Optional[bool] = None) -> None:
    """Starts the runtime: on its own NCCL communicator and streams for parameters on a GPU
    (the unique id goes to the other ranks through pg), else on pg itself (c10d, Gloo on CPU).
    check_collectives: None, as DCPLAN_CHECK_COLLECTIVES says (_check_collectives)."""
    global _runtime_started
    _runtime_started = True
    check = _check_collectives(device, pg.size()) if check_collectives is None else check_collectives
    if device.type != "cuda":
        _shm.report(_C.init(pg.group_name, reduce_bucket_bytes=reduce_bucket_bytes, check_collectives=check,
                            **_shm.settings()))
        return
    if not _C.has_nccl():
        raise RuntimeError(
            f"dcplan.shard: the model is on {device}, but dcplan._C was built without CUDA; install it with "
            "pip install . -Ccmake.define.DCPLAN_WITH_CUDA=ON, or build the cuda preset (cmake --preset cuda) "
            "and point DCPLAN_BUILD_DIR at it"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    unique_id = [_C.nccl_unique_id() if pg.rank() == 0 else None]
    dist.broadcast_object_list(unique_id, group=pg, group_src=0)
    _C.init_nccl(unique_id[0], pg.rank(), pg.size(), index, reduce_bucket_bytes=reduce_bucket_bytes,
                 check_collectives=check, timeout_s=_nccl_timeout_s())


def _nccl_timeout_s() -> float:
    """DCPLAN_NCCL_TIMEOUT: seconds after which a collective that has not completed aborts dcplan's
    NCCL communicator (default 600, as ProcessGroupNCCL's)."""
    raw = os.environ.get("DCPLAN_NCCL_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"DCPLAN_NCCL_TIMEOUT should be a positive number of seconds, got {raw!r}")
    return value


def _check_collectives(device: torch.device, world_size: int, recording: Optional[bool] = None) -> bool:
    """DCPLAN_CHECK_COLLECTIVES: whether the world_size ranks agree on each collective before
    launching it. auto (default): on CPU ranks, more than one (a single rank has no other to
    disagree with: at one rank the check was a local copy handed to Gloo's thread, 22% of a 1-rank
    replay's loop), unless recording (its all-gathers would be timed as the job's: the trace says
    instead that the replay checks, and the planner charges the checks); off on GPUs, where each
    check waits for the device. On CPU ranks each check is one more small Gloo call per collective
    (docs/runtime.md says what that costs). recording: as if recording or not (None: whether this
    process records)."""
    mode = os.environ.get("DCPLAN_CHECK_COLLECTIVES", "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(
            f"DCPLAN_CHECK_COLLECTIVES should be 'auto', 'on' or 'off', got {os.environ['DCPLAN_CHECK_COLLECTIVES']!r}"
        )
    if mode == "auto":
        return device.type != "cuda" and world_size > 1 and not (_record.active() if recording is None else recording)
    return mode == "on"


def _replay_checks_unrecorded(device: torch.device) -> bool:
    """Whether a replay of this job on more than one rank, in this environment, checks each collective
    where its recording does not (auto on CPU ranks): the trace then says so (meta.checks_collectives),
    whatever number of ranks recorded it, and dcplan plan charges the checks in a plan for more than one
    rank (a 1-rank trace's what-if for 2 included)."""
    ranks = 2  # any number of ranks above one checks alike
    return _check_collectives(device, ranks, recording=False) and not _check_collectives(device, ranks, recording=True)


def _make_shard(p: nn.Parameter, name: str, ds_id: int, world_size: int, rank: int) -> _ParamInfo:
    numel = p.numel()
    shard_numel = (numel + world_size - 1) // world_size
    flat = p.detach().reshape(-1).to(torch.float32)
    data = torch.zeros(shard_numel, dtype=torch.float32, device=p.device)
    lo = min(rank * shard_numel, numel)
    hi = min(lo + shard_numel, numel)
    data[: hi - lo].copy_(flat[lo:hi])
    shard_param = ShardParameter(data, p.requires_grad, p.shape)
    shard_param._dcplan_ds_id = ds_id  # the trace's and the plan's id of it (optimizer state, offload)
    return _ParamInfo(ds_id=ds_id, name=name, shape=p.shape, numel=numel, shard=shard_param)


def _make_pre_hook(state: _ShardState, attrs: List[str], ids: List[int]):
    """The module's parameters attrs (ds_ids ids), gathered into its __dict__."""

    def pre_hook(module, args):
        d = module.__dict__
        for attr, full in zip(attrs, state.hooks.forward_gather(ids, state.recomputing())):
            d[attr] = full

    return pre_hook


def _make_post_hook(state: _ShardState, attrs: List[str], ids: List[int]):
    def post_hook(module, args, output):
        d = module.__dict__
        # A parameter its pre-hook did not gather (the forward raised before it) is not released.
        released = [i for a, i in zip(attrs, ids) if d.pop(a, None) is not None]
        state.hooks.forward_release(released, state.recomputing())

    return post_hook


# -- parameters read outside their module's forward ----------------------------------------------
#
# A module may read another module's parameter (an output projection reading the embedding's
# weight, a root reading a block's norm). Outside its owner's forward the attribute would be the
# flat shard: the owner's class is swapped for a subclass whose __getattr__ (reached only when
# the pre-hook has not put the gathered parameter into the instance's __dict__) gathers it for
# the rest of the model's forward. The runtime's buffer is released at once; the tensor the
# reader got keeps its memory until autograd is done with it.

def _reader_body(base: type) -> Dict[str, object]:
    def __getattr__(self, name):
        ids = self.__dict__.get("_dcplan_param_ids")
        if ids is not None and name in ids:
            state = self.__dict__["_dcplan_state"]()
            if state is not None and state.forward_depth > 0:
                return state.read_outside(ids[name], False)
            if state is not None and state.recomputing():
                return state.read_outside(ids[name], True)
        return base.__getattr__(self, name)

    return {"__getattr__": __getattr__}


def _watch_outside_reads(state: _ShardState, module: nn.Module, attrs: List[str], ids: List[int]) -> None:
    if "reader" not in _class_swap.swapped(module):
        _class_swap.swap_class(module, "reader", _reader_body)
    module.__dict__["_dcplan_param_ids"] = dict(zip(attrs, ids))
    module.__dict__["_dcplan_state"] = weakref.ref(state)


def _make_root_pre_hook(state: _ShardState):
    def root_pre_hook(module, args, kwargs):
        if state.forward_depth == 0 and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "dcplan: the sharded model's own forward runs inside a backward (activation checkpointing "
                "around the whole model?); checkpoint its blocks instead, e.g. "
                "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) inside forward")
        if state.forward_depth == 0:
            _plan.check_forward(state.plan)  # before the forward opens: a refused one leaves nothing
        state.forward_depth += 1
        if state.forward_depth > 1:
            return
        state.hooks.refresh()  # stale copies go before a planned prefetch could find them held
        _plan.mark_step()
        _plan.agree_guard_excess()  # once, after the first optimizer step: the guard acts alike on every rank
        recording = _record.active()
        state.record_paused = recording and not torch.is_grad_enabled()
        if recording:
            # An eval forward is not a micro-step of the recorded steps; every training forward
            # resumes, also after an eval forward that raised before its post-hook.
            _record.pause(state.record_paused)
        _C.start_forward(torch.is_grad_enabled())
        if recording and not state.record_paused:
            _record.after_start_forward()  # ends the process once every step is recorded
        if torch.is_grad_enabled():
            recorded = _record.active()  # not once after_start_forward finished the recording
            compared = state.plan_inputs is not None and not state.inputs_warned
            if recorded or compared:
                shapes = _plan.input_shapes(args, kwargs)
                if recorded:
                    _record.input_shapes(state.fwd_graph, shapes)
                if compared:
                    _plan.check_input_shapes(state, shapes)
        if state.stage == 3 and not state.compiled:  # compiled: the partitioner re-gathers
            state.begin_saves()
            state.saved_hooks = torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack)
            state.saved_hooks.__enter__()

    return root_pre_hook


def _make_root_post_hook(state: _ShardState):
    def root_post_hook(module, args, output):
        state.forward_depth -= 1
        if state.forward_depth > 0:
            return
        state.outside.clear()
        if state.saved_hooks is not None:
            hooks, state.saved_hooks = state.saved_hooks, None
            hooks.__exit__(None, None, None)
            if state.saved is not None and torch.is_grad_enabled():  # this forward's own
                state.saved.end()
        _C.end_forward()
        if state.record_paused:
            state.record_paused = False
            _record.pause(False)
        _plan.warn_departure()
        if state.compiled and torch.is_grad_enabled():
            _begin_backward_before(state, output)

    return root_post_hook


def _begin_backward_before(state: _ShardState, output) -> None:
    """Compiled mode: the backward begins (state.begin_backward) when a gradient first reaches one
    of the forward's outputs, before the compiled backward runs; once per backward, however many
    forwards it goes through (end_backward clears in_backward, as the eager hooks' node does)."""

    def pre_hook(grad_outputs):
        if state.hooks.in_backward:
            return
        state.hooks.in_backward = True
        try:
            state.begin_backward()
        except BaseException:
            state.hooks.in_backward = False  # not begun: the next backward tries again
            raise

    hooked = False
    for t in torch.utils._pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.grad_fn.register_prehook(pre_hook)
            hooked = True
    if not hooked and state.trainable_ids:
        warnings.warn(
            f"dcplan: the compiled model's output ({type(output).__name__}) holds no tensor with a gradient "
            "history: a backward through this forward would reduce no gradient (return the tensors a loss is "
            "computed from)", RuntimeWarning, stacklevel=3)


@torch.no_grad()
def full_parameters(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) fp32 value of every parameter of a sharded model, by qualified name.

    A collective: every rank of the model's group must call it.
    """
    state = getattr(model, "_dcplan", None)
    if state is None:
        raise ValueError("dcplan.full_parameters: model is not sharded by dcplan.shard()")
    out = {}
    for info in state.infos:
        with _offload.masters_on_device([info]):  # a master shard a plan keeps on the host, for its gather
            # Through the runtime, not dist.all_gather: Gloo's worker would otherwise drop Python
            # tensors after the call returns, which needs the GIL and aborts at interpreter exit.
            full = _C.all_gather_flat(info.shard.detach())
        out[info.name] = full[: info.numel].view(info.shape).clone()
    return out


def init(process_group: Optional[dist.ProcessGroup] = None, *, device="cpu") -> None:
    """Starts dcplan's runtime on process_group (default: the world) without sharding a model,
    for calling the ``torch.ops.dc.*`` ops directly, such as ``inference_all_reduce``.

    A collective: every rank of the group calls it. ``dcplan.shard()`` on the same group later
    uses this runtime. On CPU ranks that all share this machine's memory, the inference
    all-reduce goes through shared memory (``DCPLAN_SHM``, ``DCPLAN_SHM_DIR``,
    ``DCPLAN_SHM_TIMEOUT``: docs/runtime.md); otherwise through the process group, with one
    ShmFallbackWarning saying why.
    """
    global _runtime_group
    _check_group("dcplan.init", process_group)
    pg = process_group if process_group is not None else dist.group.WORLD
    if _C.is_initialized():
        if _runtime_group == pg.group_name:
            return
        raise ValueError(
            f"dcplan.init: the runtime runs on process group '{_runtime_group}', got '{pg.group_name}'; "
            "call dcplan.shutdown() first"
        )
    _init_runtime(pg, torch.device(device), _DEFAULT_BUCKET_BYTES)
    _runtime_group = pg.group_name


@atexit.register
def _cleanup_at_exit() -> None:
    # Pending collectives are waited for and the process group released while
    # Python and torch are still alive, not during static destruction; captured graphs first.
    try:
        _graphed.release_graphs()
    finally:
        _C.cleanup()
    if _runtime_started:
        # A Gloo worker thread that ran the script's last collective may still hold the script's
        # tensors; dropping the last reference of a Python tensor takes the GIL, and a thread
        # that takes it once the interpreter finalizes is ended inside a destructor (the process
        # aborts: "terminate called without an active exception"). The process group outlives
        # dist.destroy_process_group() once an optimizer was made (torch 2.13), so its workers
        # are not joined before then. Released GIL for a moment: they finish now.
        time.sleep(_EXIT_GRACE_S)


def shutdown() -> None:
    """Stops the runtime: every sharded model of this process stops working."""
    global _runtime_group, _next_ds_id, _next_graph_id
    _graphed.release_graphs()  # first: the device is done with the graphs before the rest is forgotten
    _record.stop()
    _plan.stop_marks()
    _plan.forget()
    _offload.forget()
    _C.cleanup()
    _runtime_group = None
    _next_ds_id = 0
    _next_graph_id = 0
