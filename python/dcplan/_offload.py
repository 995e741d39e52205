"""Planned offload of optimizer state and master shards (docs/planning.md, "Offload").

A plan's ``offload.optimizer_state`` lists groups of parameters whose optimizer state (AdamW's
``exp_avg`` and ``exp_avg_sq``) lives in host memory between optimizer steps. At the step of
an optimizer that holds such shards, torch's global step pre-hook runs the step itself, group by
group: first every other parameter, while the first group's state is copied back; then each
group once its state is back, the next group's copy in running beside its update, and its own
copy out issued after it. The optimizer's ``step()`` itself then finds no parameters: its
param groups are empty until its post-hook puts them back.

Between steps ``optimizer.state[p]`` holds the host copies (pinned on a GPU; on CPU ranks memory
of their own, outside torch's allocator, so that the device's counted memory is what a GPU's
would be). Each group's host memory is allocated once, when the plan is loaded (before step 0:
the plan's bytes for the group), and each state tensor's copy is a view into it, taken at the
state's first step (or a loaded state dict) and reused.

A group may keep its master shards on the host too (ZeRO-3): the runtime holds them there from
registration on, brings one back for each of its gathers and drops it once the gather is done;
here they come back just before the group's update and go out again just after it.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _C

# ds_id -> the shard (weakly held: a model dropped takes its plan's offload with it) and its group.
_shards: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_group_of: Dict[int, int] = {}
_group_count = 0  # groups registered so far, over every model: _group_of's stepping order
_masters: set = set()  # ds_ids whose master shards the runtime keeps on the host
_pools: Dict[int, "_HostPool"] = {}  # group -> its host memory, allocated at registration
# (ds_id, state key) -> (its host copy: a view of its group's pool, the optimizer using it (weakly)).
_slots: Dict[tuple, tuple] = {}
_pool_finalizers: list = []  # a group's pool goes when its first shard does (a model dropped)
_handles = []
# An optimizer -> its param groups' lists while its own step() runs over none.
_emptied: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_running = False


def state_bytes(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """The per-element optimizer state of each dcplan shard `optimizer` steps, bytes by ds_id
    (the trace's optimizer_state_bytes)."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            ds_id = getattr(p, "_dcplan_ds_id", None)
            if ds_id is None:
                continue
            out[ds_id] = sum(t.nbytes for t in _per_element(optimizer, p).values())
    return out


def is_per_element(t, shard: torch.Tensor) -> bool:
    """Whether optimizer state t holds one value per element of `shard` (Adam's moments), not a
    scalar (its step count): the state that is sharded in state dicts and offloaded by a plan."""
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == shard.detach().numel()


def _per_element(optimizer, p) -> Dict[str, torch.Tensor]:
    return {k: t for k, t in optimizer.state.get(p, {}).items() if is_per_element(t, p)}


# Each state tensor of a pool starts at a multiple of this (as torch's CUDA allocators align
# theirs); a pool holds room for that padding beside the plan's bytes, for up to
# _TENSORS_PER_PARAM tensors per parameter (AdamW has two per-element ones, AMSGrad three).
_ALIGN = 64
_TENSORS_PER_PARAM = 4


def aligned(nbytes: int) -> int:
    """nbytes rounded up to the host buffers' alignment (_ALIGN)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class _HostPool:
    """One offload group's host memory, allocated when the plan is loaded, taken in aligned views as
    its state tensors first need host copies. plan, index and planned name the plan's group and
    its bytes (for the message when state does not fit)."""

    def __init__(self, plan: str, index: int, planned: int, params: int, device: torch.device):
        self.plan, self.index, self.planned = plan, index, planned
        raw = host_empty((self.request(planned, params),), torch.uint8, device)
        skip = -raw.data_ptr() % _ALIGN  # numpy's memory (CPU ranks) is only 16-byte aligned
        self.buffer = raw[skip:skip + raw.numel() - _ALIGN]
        self.used = 0
        self.warned = False

    @staticmethod
    def request(planned: int, params: int) -> int:
        """The bytes a pool asks for: the plan's for a group of `params` parameters, room to align
        their tensors, and room to start aligned."""
        return planned + _ALIGN * _TENSORS_PER_PARAM * params + _ALIGN

    def take(self, shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A view of shape and dtype at the next aligned offset; None where the pool is full."""
        start = aligned(self.used)
        nbytes = _nbytes(shape, dtype)
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        view = self.buffer[start:start + nbytes].view(dtype).view(shape)
        view._dcplan_host_buffer = True
        return view


def _drop_pool(group: int, pool: _HostPool) -> None:
    """A dropped model's pool and the slots taken from it (the optimizer's state keeps its own)."""
    if _pools.get(group) is pool:
        del _pools[group]
    for slot in [k for k, (_, _, p) in list(_slots.items()) if p is pool]:
        del _slots[slot]


def host_bytes(groups: List[List[int]], group_bytes: List[int]) -> int:
    """The host memory allocate() asks for the plan's groups: their bytes, and room to align."""
    return sum(_HostPool.request(b, len(ids)) for ids, b in zip(groups, group_bytes))


def allocate(infos, groups: List[List[int]], group_bytes: List[int], masters: List[int], plan: str) -> List[_HostPool]:
    """Each of the plan's groups' host memory (group_bytes, from the file `plan`), in order, and
    the master shards of `masters` moved to the host (the runtime's own copies there); raises where
    the host does not give it (dcplan.shard agrees on that over the ranks)."""
    by_id = {i.ds_id: i.shard for i in infos}
    pools = [_HostPool(plan, g, group_bytes[g], len(ids), by_id[ids[0]].device) for g, ids in enumerate(groups)]
    if masters:
        _C.set_masters_on_host(list(masters))
    return pools


def register(infos, groups: List[List[int]], masters: List[int], pools: Optional[List[_HostPool]] = None) -> None:
    """A model sharded with a plan that offloads: infos its parameters, groups the plan's, pools
    their host memory (allocate(); None: each state tensor's own, at its first step) and masters
    the ids of those whose master shards allocate() moved to the host (checked against the model
    when the plan was loaded)."""
    global _group_count
    if not groups:
        return
    _masters.update(masters)
    by_id = {i.ds_id: i.shard for i in infos}
    _pool_finalizers[:] = [f for f in _pool_finalizers if f.alive]
    for g, ids in enumerate(groups):
        for i in ids:
            _shards[i] = by_id[i]
            _group_of[i] = _group_count
        if pools is not None:
            _pools[_group_count] = pools[g]
            done = weakref.finalize(by_id[ids[0]], _drop_pool, _group_count, pools[g])
            done.atexit = False  # at exit the process lets go of it all anyway
            _pool_finalizers.append(done)
        _group_count += 1
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before_step))
        _handles.append(register_optimizer_step_post_hook(_after_step))


def has_masters() -> bool:
    """Whether a plan keeps master shards on the host (what a captured step refuses)."""
    return bool(_masters)


def masters_of(infos) -> List[int]:
    """The ds_ids of infos whose master shards a plan keeps on the host."""
    return [i.ds_id for i in infos if i.ds_id in _masters]


@contextlib.contextmanager
def masters_on_device(infos):
    """The master shards of infos that a plan keeps on the host, back on the device for the block
    (a state dict reads or writes them), copied out and dropped again after it."""
    ids = masters_of(infos)
    if ids:
        _C.reload_masters(ids)
    try:
        yield
    finally:
        if ids:
            _C.offload_masters(ids)


def forget() -> None:
    """dcplan.shutdown(): no plan offloads any more; master shards come back, so that the model's
    parameters hold their values once the runtime is gone."""
    global _group_count
    if _masters:
        _C.reload_masters(sorted(_masters))
        _masters.clear()
    _shards.clear()
    _group_of.clear()
    for f in _pool_finalizers:
        f.detach()
    _pool_finalizers.clear()
    _pools.clear()
    _slots.clear()
    _group_count = 0
    for h in _handles:
        h.remove()
    _handles.clear()


# The copy streams of each device, made once: the caching allocator keeps a freed block for the
# stream it was made on, so streams made anew each step would leave blocks behind.
_streams: Dict[torch.device, tuple] = {}


def is_host(t: torch.Tensor) -> bool:
    """Whether t is a host buffer where a plan keeps state or a master shard (host_empty's)."""
    return getattr(t, "_dcplan_host_buffer", False)


class _Mover:
    """Copies optimizer state between the device and its host buffers: on a GPU on a copy-in and a
    copy-out stream, ordered by stream waits against the compute stream (no record_stream, which a
    CUDA graph's capture would hold until its end). A group's device copy is dropped once the
    compute stream has waited for its copy out, two groups later: at most three groups are on the
    device at once (the one dropped next, the one updated, the one coming in)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.pending: List[tuple] = []  # per group copied out: (its device copies, copied-out event)
        self.host_of: Dict[int, torch.Tensor] = {}  # id(device copy) -> its host buffer, this step
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            if device not in _streams:
                _streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self.to_device, self.to_host = _streams[device]
            # Forked from the compute stream: a captured step (dcplan.graphed_step) takes both into
            # its graph, which a wait on work outside the capture would invalidate.
            self.to_device.wait_stream(self.compute)
            self.to_host.wait_stream(self.compute)

    def reload(self, optimizer, params) -> None:
        """Copies params' host state into new device tensors (on the copy-in stream)."""
        if self.cuda:
            self.to_device.wait_stream(self.compute)  # a reused block's last use on the compute stream
        for p in params:
            for key, host in _per_element(optimizer, p).items():
                if not is_host(host):
                    continue  # on the device already (a state its first update makes)
                dev = torch.empty_like(host, device=self.device)  # on the compute stream
                self._copy(dev, host, self.to_device if self.cuda else None)
                optimizer.state[p][key] = dev
                self.host_of[id(dev)] = host

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """dst <- src: queued on `stream` (a GPU's copy stream), else now."""
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def ready(self) -> None:
        """The compute stream waits for the copies in queued so far."""
        if self.cuda:
            self.compute.wait_stream(self.to_device)

    def offload(self, optimizer, params) -> None:
        """Copies params' device state out to their host buffers (after their update); the state
        is the host buffer from now on, the device copy kept until retire()."""
        if self.cuda:
            self.to_host.wait_stream(self.compute)
        copies = []
        for p in params:
            for key, dev in _per_element(optimizer, p).items():
                host = self.host_of.pop(id(dev), None)
                if host is None:  # the state's first step made it
                    host = host_slot(optimizer, p, key, dev)
                self._copy(host, dev, self.to_host if self.cuda else None)
                optimizer.state[p][key] = host
                copies.append(dev)
        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.to_host)
        self.pending.append((copies, done))

    def retire(self, keep: int) -> None:
        """Drops the device copies of all but the last `keep` groups copied out, once their copies
        out are done on the device (the compute stream waits for those, not for later ones)."""
        while len(self.pending) > keep:
            copies, done = self.pending.pop(0)
            if done is not None:
                self.compute.wait_event(done)
            del copies


def keeps_state_on_host(p: torch.Tensor) -> bool:
    """Whether a plan keeps shard p's per-element optimizer state on the host between steps."""
    i = getattr(p, "_dcplan_ds_id", None)
    return i is not None and _shards.get(i) is p


def master_host(ds_id: int) -> torch.Tensor:
    """The host copy of a master shard a plan keeps on the host (between steps), marked as a host
    buffer."""
    host = _C.master_host(ds_id)
    host._dcplan_host_buffer = True
    return host


def host_copies_ready(device: torch.device) -> None:
    """On a GPU, waits until the copies out to host memory queued so far are done (a state dict
    then reads or writes them on the host); on CPU ranks they were made in place."""
    if device.type == "cuda" and (_masters or len(_shards)):
        torch.cuda.current_stream(device).synchronize()


def host_copy(optimizer, p: torch.Tensor, key: str, t: torch.Tensor) -> torch.Tensor:
    """optimizer's host buffer for shard p's state `key`, holding t's values: what a loaded state
    dict's state becomes for a parameter whose state a plan keeps on the host."""
    host = host_slot(optimizer, p, key, t)
    host.copy_(t)
    return host


def host_slot(optimizer, p: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
    """optimizer's host buffer for shard p's state `key` (a tensor like `like`): a view of the
    group's pool taken once, then the same one, also for a new optimizer once the one that used it
    is gone. Where it does not fit (state beyond the plan's bytes: an optimizer other than the
    recorded one, or a second live optimizer over the same shards) it gets memory of its own, with
    a warning (once per group): the host check before step 0 did not count it."""
    slot = (p._dcplan_ds_id, key)
    pool = _pools.get(_group_of[p._dcplan_ds_id])
    found = _slots.get(slot)
    user = found[1]() if found is not None else None
    taken = None
    if found is not None and user in (None, optimizer) and found[0].shape == like.shape and \
            found[0].dtype == like.dtype:
        taken = found[0]
    elif pool is not None and user is None:
        taken = pool.take(like.shape, like.dtype)  # a first slot, or another shape than its gone user's
    if taken is not None:
        _slots[slot] = (taken, weakref.ref(optimizer), pool)
        return taken
    if pool is not None and not pool.warned:
        pool.warned = True
        warnings.warn(f"dcplan: {pool.plan}: /offload/optimizer_state/{pool.index}/bytes: the plan keeps "
                      f"{pool.planned} bytes of optimizer state on the host for this group, and the state "
                      f"{key!r} of parameter ds_id {p._dcplan_ds_id} ({_nbytes(like.shape, like.dtype)} bytes) "
                      "does not fit beside what it holds (an optimizer other than the recorded one, or a second "
                      "one over the same model): allocated apart, beyond what the host memory check before "
                      "step 0 counted. Record the optimizer this run steps and plan again")
    return host_empty(like.shape, like.dtype, like.device)


def staging(like: torch.Tensor) -> torch.Tensor:
    """Host memory of its own for a copy of `like` that waits to go into a host buffer: ordinary
    (pageable) memory for a GPU's, which torch's pinned allocator would keep cached after its use;
    on CPU ranks memory outside torch's allocator, as every host buffer there."""
    if like.device.type == "cuda":
        return torch.empty(like.shape, dtype=like.dtype)
    return host_empty(like.shape, like.dtype, like.device)


def host_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host buffer for a model on device: pinned for a GPU's; on CPU ranks memory outside
    torch's CPU allocator, which dcplan counts as the device's memory there."""
    if device.type == "cuda":
        host = torch.empty(shape, dtype=dtype, pin_memory=True)
    else:
        host = torch.from_numpy(np.empty(_nbytes(shape, dtype), dtype=np.uint8)).view(dtype).view(shape)
    host._dcplan_host_buffer = True  # on CPU ranks the device's tensors are CPU tensors too
    return host


def _planned_groups(optimizer) -> Optional[List[list]]:
    """The plan's groups among optimizer's parameters, in stepping order; None: it steps none."""
    found: Dict[int, list] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if keeps_state_on_host(p):
                found.setdefault(_group_of[p._dcplan_ds_id], []).append(p)
    if not found:
        return None
    return [found[g] for g in sorted(found)]


def _step_only(optimizer, params, raw_step) -> None:
    """optimizer's own step() (its hooks left out) over params only, each in its param group."""
    wanted = {id(p) for p in params}
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g, ps in zip(optimizer.param_groups, saved):
            g["params"] = [p for p in ps if id(p) in wanted]
        raw_step(optimizer)
    finally:
        for g, ps in zip(optimizer.param_groups, saved):
            g["params"] = ps


def _before_step(optimizer, args, kwargs) -> None:
    global _running
    if _running:
        return
    _restore(optimizer)  # a step that raised after the groups were emptied left them so
    groups = _planned_groups(optimizer)
    if groups is None:
        return
    if len(args) > 1 or kwargs:  # torch passes (self, *args)
        raise ValueError(f"dcplan: {type(optimizer).__name__}.step() with arguments (a closure) cannot run group "
                         "by group, as the plan's optimizer-state offload needs; call step() without them")
    raw_step = getattr(type(optimizer).step, "__wrapped__", None)
    if raw_step is None:
        raise RuntimeError(f"dcplan: {type(optimizer).__name__}.step is not torch's hooked step; the plan's "
                           "optimizer-state offload steps the optimizer group by group through it")
    offloaded = {id(p) for ps in groups for p in ps}
    resident = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in offloaded]
    mover = _Mover(groups[0][0].device)
    _running = True
    try:
        mover.reload(optimizer, groups[0])
        if resident:
            _step_only(optimizer, resident, raw_step)
        for k, params in enumerate(groups):
            mover.ready()
            mover.retire(keep=1)  # the group before this one may still be copying out
            if k + 1 < len(groups):
                mover.reload(optimizer, groups[k + 1])
            masters = [p._dcplan_ds_id for p in params if p._dcplan_ds_id in _masters]
            if masters:  # in the update's turn, on the compute stream (the planner's model)
                _C.reload_masters(masters)
            try:
                _step_only(optimizer, params, raw_step)
            finally:  # copied out even after a failed update: a gather drops them without a copy
                if masters:
                    _C.offload_masters(masters)
            mover.offload(optimizer, params)
        mover.retire(keep=0)  # the step ends with every copy out done on the device
    finally:
        _running = False
    # The step() that called this hook runs over nothing; _after_step gives the groups back.
    _emptied[optimizer] = [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = []


def _restore(optimizer) -> None:
    saved = _emptied.pop(optimizer, None)
    if saved is not None:
        for g, ps in zip(optimizer.param_groups, saved):
            g["params"] = ps


def _after_step(optimizer, args, kwargs) -> None:
    _restore(optimizer)
