"""Planned offload of optimizer state (docs/planning.md, "Offload").

A plan's ``offload.optimizer_state`` lists groups of parameters whose optimizer state (AdamW's
``exp_avg`` and ``exp_avg_sq``) lives in host memory between optimizer steps. At the step of
an optimizer that holds such shards, torch's global step pre-hook runs the step itself, group by
group: first every other parameter, while the first group's state is copied back; then each
group once its state is back, the next group's copy in running beside its update, and its own
copy out issued after it. The optimizer's ``step()`` itself then finds no parameters: its
param groups are empty until its post-hook puts them back.

Between steps ``optimizer.state[p]`` holds the host copies (pinned on a GPU; on CPU ranks a
pool of their own, outside torch's allocator, so that the device's counted memory is what a
GPU's would be). Each host buffer is allocated once, when its state first exists, and reused.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# ds_id -> the shard (weakly held: a model dropped takes its plan's offload with it) and its group.
_shards: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_group_of: Dict[int, int] = {}
_groups: List[List[int]] = []  # ds_ids per group, in stepping order
_handles = []
_emptied: Dict[int, list] = {}  # id(optimizer) -> its param groups' lists while its step() runs
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


def _per_element(optimizer, p) -> Dict[str, torch.Tensor]:
    """p's optimizer state tensors of p's own size (not the step count or other scalars)."""
    n = p.detach().numel()
    return {k: t for k, t in optimizer.state.get(p, {}).items()
            if isinstance(t, torch.Tensor) and t.numel() == n and n > 1}


def register(infos, groups: List[List[int]]) -> None:
    """A model sharded with a plan that offloads: infos its parameters, groups the plan's."""
    if not groups:
        return
    by_id = {i.ds_id: i.shard for i in infos}
    for ids in groups:
        _groups.append([i for i in ids if i in by_id])
        for i in ids:
            _shards[i] = by_id[i]
            _group_of[i] = len(_groups) - 1
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before_step))
        _handles.append(register_optimizer_step_post_hook(_after_step))


def forget() -> None:
    """dcplan.shutdown(): no plan offloads any more."""
    _shards.clear()
    _group_of.clear()
    _groups.clear()
    for h in _handles:
        h.remove()
    _handles.clear()


class _Mover:
    """Copies optimizer state between the device and its host buffers; on a GPU on two streams
    of their own, ordered by events against the compute stream."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.to_device = torch.cuda.Stream(device)
            self.to_host = torch.cuda.Stream(device)
            # Forked from the compute stream: a captured step (dcplan.graphed_step) takes both into
            # its graph, which an event from a stream outside the capture would invalidate.
            self.to_device.wait_stream(self.compute)
            self.to_host.wait_stream(self.compute)

    def host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        else:
            # Outside torch's CPU allocator, which dcplan counts as the device's memory on CPU ranks.
            host = torch.from_numpy(np.empty(t.nbytes, dtype=np.uint8)).view(t.dtype).view(t.shape)
        host._dcplan_host_buffer = True  # on CPU ranks the device's tensors are CPU tensors too
        return host

    def reload(self, optimizer, params) -> None:
        """Copies params' host state to new device tensors (queued on the copy-in stream)."""
        for p in params:
            for key, host in _per_element(optimizer, p).items():
                if not getattr(host, "_dcplan_host_buffer", False):
                    continue  # on the device already (a state made by this step's update)
                if self.cuda:
                    self.to_device.wait_stream(self.to_host)  # its copy out of the last step is done
                    with torch.cuda.stream(self.to_device):
                        dev = torch.empty_like(host, device=self.device)
                        dev.copy_(host, non_blocking=True)
                else:
                    dev = host.clone()
                optimizer.state[p][key] = dev
                _host_of[id(dev)] = host

    def ready(self) -> None:
        """The compute stream waits for the copies in queued so far."""
        if self.cuda:
            self.compute.wait_stream(self.to_device)

    def offload(self, optimizer, params) -> None:
        """Copies params' device state out to their host buffers; the device tensors go."""
        if self.cuda:
            self.to_host.wait_stream(self.compute)  # after the update
        for p in params:
            for key, dev in _per_element(optimizer, p).items():
                host = _host_of.pop(id(dev), None)
                if host is None:
                    host = self.host_buffer(dev)  # the state's first step made it: its buffer, once
                if self.cuda:
                    with torch.cuda.stream(self.to_host):
                        host.copy_(dev, non_blocking=True)
                    dev.record_stream(self.to_host)  # not reused before the copy out is done
                else:
                    host.copy_(dev)
                optimizer.state[p][key] = host

    def done(self) -> None:
        """The step ends after its copies out (the next use of the host copies is ordered after)."""
        if self.cuda:
            self.compute.wait_stream(self.to_host)


_host_of: Dict[int, torch.Tensor] = {}  # id(device copy) -> its host buffer, during a step


def _planned_groups(optimizer) -> Optional[List[list]]:
    """The plan's groups among optimizer's parameters, in stepping order; None: it steps none."""
    found: Dict[int, list] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            i = getattr(p, "_dcplan_ds_id", None)
            if i is not None and _shards.get(i) is p:
                found.setdefault(_group_of[i], []).append(p)
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
    groups = _planned_groups(optimizer)
    if groups is None:
        return
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # torch passes (self, *args)
    if closure is not None:
        raise ValueError(f"dcplan: {type(optimizer).__name__}.step() with a closure cannot run group by group, "
                         "as the plan's optimizer-state offload needs; step without one")
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
            if k + 1 < len(groups):
                mover.reload(optimizer, groups[k + 1])
            _step_only(optimizer, params, raw_step)
            mover.offload(optimizer, params)
        mover.done()
    finally:
        _running = False
        _host_of.clear()
    # The step() that called this hook runs over nothing; _after_step gives the groups back.
    _emptied[id(optimizer)] = [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = []


def _after_step(optimizer, args, kwargs) -> None:
    saved = _emptied.pop(id(optimizer), None)
    if saved is not None:
        for g, ps in zip(optimizer.param_groups, saved):
            g["params"] = ps
