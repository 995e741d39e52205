"""State dicts of sharded models and their optimizers: full (original shapes, loadable into the
plain model) and sharded (DTensors for torch.distributed.checkpoint, which reshards on load).

The API follows torch.distributed.checkpoint.state_dict, which FSDP2 users call:
``get_model_state_dict`` / ``set_model_state_dict``, ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` and ``StateDictOptions`` (ours, or torch's: the same fields).

Sharded form: each parameter is a 1-D DTensor of its numel elements, placement Shard(0) over the
model's ranks; this rank's local tensor is its shard without the padding, a view of the shard
itself, so that ``dcp.load`` writes straight into the model. A checkpoint saved on N ranks loads
on M: DCP reads the element ranges each rank needs. Parameters are flattened (a flat shard is not
a box of the original shape); the full form has the original shapes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _C

_PARAMS = "params"


@dataclasses.dataclass
class StateDictOptions:
    """What the state dict functions produce and accept (the fields of torch's StateDictOptions).

    full_state_dict: original shapes, every element (a collective: every rank calls it);
    otherwise sharded DTensors for torch.distributed.checkpoint.
    cpu_offload: full tensors on the CPU, and only rank 0 keeps them (the others get {}).
    broadcast_from_rank0: set_*: only rank 0 passes a full state dict; the others pass {}.
    strict: set_model_state_dict: missing or unexpected keys are an error.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True


class IncompatibleKeys(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def _state(model: nn.Module, caller: str):
    state = getattr(model, "_dcplan", None)
    if state is None:
        raise ValueError(f"dcplan.{caller}: model is not sharded by dcplan.shard(); use model.state_dict() "
                         "or torch.distributed.checkpoint.state_dict for an unsharded model")
    return state


def _options(options, caller: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    fields = [f.name for f in dataclasses.fields(StateDictOptions)]
    if not all(hasattr(options, f) for f in fields):
        raise ValueError(f"dcplan.{caller}: options should be a dcplan.StateDictOptions (or torch's), "
                         f"got {type(options).__name__}")
    opts = StateDictOptions(**{f: bool(getattr(options, f)) for f in fields})
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError(f"dcplan.{caller}: broadcast_from_rank0=True needs full_state_dict=True")
    return opts


def _group(state) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(state.group_name)


def _by_shard(state) -> Dict[int, Any]:
    """id(shard) -> _ParamInfo."""
    return {id(i.shard): i for i in state.infos}


def _valid(info, rank: int, world_size: int) -> Tuple[int, int]:
    """(offset, length) of this rank's elements of info's parameter (its shard without padding)."""
    s = info.shard.numel()
    lo = min(rank * s, info.numel)
    return lo, min(lo + s, info.numel) - lo


class _Sharder:
    """Turns a shard-shaped tensor into its full or sharded state-dict form, and back."""

    def __init__(self, state, opts: StateDictOptions):
        self.state, self.opts = state, opts
        self.pg = _group(state)
        self.rank, self.world_size = self.pg.rank(), self.pg.size()
        self._mesh = None

    @property
    def keeps_full(self) -> bool:
        """Whether this rank keeps full tensors (cpu_offload: rank 0 only)."""
        return not self.opts.cpu_offload or self.rank == 0

    def mesh(self, device: torch.device):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.pg, device.type)
        return self._mesh

    def out(self, info, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t (shard-shaped, e.g. the shard or an Adam moment) in the state dict's form."""
        if self.opts.full_state_dict:
            full = _C.all_gather_flat(t.detach())  # a collective: every rank, whatever it keeps
            if not self.keeps_full:
                return None
            full = full[: info.numel].view(info.shape)
            return full.cpu() if self.opts.cpu_offload else full.clone()
        from torch.distributed.tensor import DTensor, Shard

        lo, n = _valid(info, self.rank, self.world_size)
        return DTensor.from_local(t.detach()[:n], self.mesh(t.device), [Shard(0)], run_check=False,
                                  shape=torch.Size([info.numel]), stride=(1,))

    def load(self, info, dst: torch.Tensor, value, key: str, caller: str) -> None:
        """Copies value (this key's state-dict form) into dst, shard-shaped."""
        from torch.distributed.tensor import DTensor

        lo, n = _valid(info, self.rank, self.world_size)
        with torch.no_grad():
            if isinstance(value, DTensor):
                if tuple(value.shape) != (info.numel,):
                    raise ValueError(f"dcplan.{caller}: '{key}' should be a DTensor of shape ({info.numel},) "
                                     f"(sharded state dict), got {tuple(value.shape)}")
                local = value.to_local()
                if local.numel() != n:
                    raise ValueError(f"dcplan.{caller}: '{key}': this rank's DTensor part has {local.numel()} "
                                     f"elements, expected {n} (placement Shard(0) over {self.world_size} ranks)")
                src = local.reshape(-1)
            else:
                if not isinstance(value, torch.Tensor) or value.numel() != info.numel:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"dcplan.{caller}: '{key}' should be a tensor of {info.numel} elements "
                                     f"(shape {tuple(info.shape)}), got {got}")
                src = value.detach().reshape(-1)[lo:lo + n]
            if src.data_ptr() != dst.data_ptr():  # else dcp.load wrote into the shard itself
                dst[:n].copy_(src)
            dst[n:].zero_()

    def broadcast(self, value: Optional[torch.Tensor], like: torch.Tensor, shape, dtype) -> torch.Tensor:
        """Rank 0's value, on every rank (broadcast_from_rank0)."""
        buf = value.detach().to(like.device, dtype) if self.rank == 0 else torch.empty(shape, dtype=dtype,
                                                                                        device=like.device)
        dist.broadcast(buf, group=self.pg, group_src=0)
        return buf


# -- model -----------------------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, options=None) -> Dict[str, Any]:
    """The sharded model's state dict under model.state_dict()'s keys (tied parameters under each
    of their names, buffers included).

    Default: parameters as 1-D DTensors (torch.distributed.checkpoint). ``full_state_dict=True``:
    fp32 tensors of the original shapes, loadable with ``load_state_dict`` into the unsharded
    model; ``cpu_offload=True`` too: on the CPU, and only rank 0's dict has them. A collective.
    """
    state = _state(model, "get_model_state_dict")
    opts = _options(options, "get_model_state_dict")
    sharder = _Sharder(state, opts)
    infos = _by_shard(state)
    done: Dict[int, Optional[torch.Tensor]] = {}
    out: Dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        info = infos.get(id(value))
        if info is None:  # a buffer: the same on every rank
            if sharder.keeps_full:
                out[key] = value.detach().cpu() if opts.cpu_offload else value.detach()
            continue
        if id(value) not in done:
            done[id(value)] = sharder.out(info, value)
        if done[id(value)] is not None:
            out[key] = done[id(value)]
    return out


def set_model_state_dict(model: nn.Module, model_state_dict: Dict[str, Any], *, options=None) -> IncompatibleKeys:
    """Loads a full or sharded state dict (get_model_state_dict's, or the unsharded model's
    ``state_dict()``) into the sharded model's shards and buffers. A collective.

    Full tensors: every rank passes the whole dict, or with ``broadcast_from_rank0=True`` only
    rank 0 does (the others pass {}). ``strict`` (default True): a missing or unexpected key is a
    ValueError naming it. Returns (missing_keys, unexpected_keys).
    """
    caller = "set_model_state_dict"
    state = _state(model, caller)
    opts = _options(options, caller)
    sharder = _Sharder(state, opts)
    infos = _by_shard(state)
    own = model.state_dict(keep_vars=True)
    if opts.broadcast_from_rank0:
        keys = [sorted(model_state_dict) if sharder.rank == 0 else None]
        dist.broadcast_object_list(keys, group=sharder.pg, group_src=0)
        given = keys[0]
    else:
        given = sorted(model_state_dict)
    missing = sorted(set(own) - set(given))
    unexpected = sorted(set(given) - set(own))
    if opts.strict and (missing or unexpected):
        raise ValueError(f"dcplan.{caller}: the state dict does not match the model: missing keys {missing}, "
                         f"unexpected keys {unexpected} (pass StateDictOptions(strict=False) to load the rest)")
    loaded = set()
    for key in sorted(set(own) & set(given)):
        dst = own[key]
        info = infos.get(id(dst))
        value = model_state_dict.get(key)
        if opts.broadcast_from_rank0:
            shape = info.shape if info is not None else dst.shape
            value = sharder.broadcast(value, dst, shape, torch.float32 if info is not None else dst.dtype)
        if info is None:
            with torch.no_grad():
                dst.copy_(value.reshape(dst.shape) if isinstance(value, torch.Tensor) else value)
            continue
        if id(dst) in loaded:  # a tied parameter: its first name loaded it
            continue
        sharder.load(info, dst.detach(), value, key, caller)
        loaded.add(id(dst))
    return IncompatibleKeys(missing, unexpected)


# -- optimizer --------------------------------------------------------------------------------

def _optim_params(state, optim: torch.optim.Optimizer, caller: str) -> List[List[Any]]:
    """Per param group, the _ParamInfo of each of its parameters."""
    infos = _by_shard(state)
    groups = []
    for g, group in enumerate(optim.param_groups):
        row = []
        for p in group[_PARAMS]:
            info = infos.get(id(p))
            if info is None:
                raise ValueError(f"dcplan.{caller}: param group {g} of the optimizer holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a shard of this model; build the optimizer on "
                                 "model.parameters() after dcplan.shard()")
            row.append(info)
        groups.append(row)
    return groups


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """A fresh optimizer's state, made by one step with zero gradients at lr 0 (as torch's
    state-dict functions do), so that a checkpoint has tensors to load into."""
    if optim.state or any(p.grad is not None for g in optim.param_groups for p in g[_PARAMS]):
        return
    for group in optim.param_groups:
        for p in group[_PARAMS]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _is_sharded_state(t, info) -> bool:
    """Whether optimizer state t is per element of the shard (Adam's moments), not a scalar (step)."""
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == info.shard.numel()


def get_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, *, options=None) -> Dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, as torch.distributed.checkpoint's:
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. Per-element
    state (Adam's moments) takes the parameters' form (options as get_model_state_dict's);
    scalars (``step``) are kept as they are. A fresh optimizer's state is made first (a step at
    lr 0 with zero gradients), so that DCP has tensors to load into. A collective.
    """
    caller = "get_optimizer_state_dict"
    state = _state(model, caller)
    opts = _options(options, caller)
    sharder = _Sharder(state, opts)
    groups = _optim_params(state, optim, caller)
    _init_optim_state(optim)
    out_state: Dict[str, Dict[str, Any]] = {}
    out_groups = []
    for group, infos in zip(optim.param_groups, groups):
        out_groups.append({**{k: v for k, v in group.items() if k != _PARAMS}, _PARAMS: [i.name for i in infos]})
        for p, info in zip(group[_PARAMS], infos):
            entry = {}
            for key, value in sorted(optim.state.get(p, {}).items()):
                if _is_sharded_state(value, info):
                    value = sharder.out(info, value)
                    if value is None:
                        continue
                elif isinstance(value, torch.Tensor):
                    value = value.detach().cpu() if opts.cpu_offload else value.detach().clone()
                entry[key] = value
            if entry and sharder.keeps_full:
                out_state[info.name] = entry
    if not sharder.keeps_full:
        return {}
    return {"state": out_state, "param_groups": out_groups}


def set_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Dict[str, Any], *,
                             options=None) -> None:
    """Loads get_optimizer_state_dict's form (full or sharded, saved on any number of ranks) into
    the optimizer: its state and its param groups' settings (lr, betas, ...). A collective."""
    caller = "set_optimizer_state_dict"
    state = _state(model, caller)
    opts = _options(options, caller)
    sharder = _Sharder(state, opts)
    groups = _optim_params(state, optim, caller)
    if opts.broadcast_from_rank0:
        # The structure (names, scalars, settings) as objects; per-element tensors one by one below.
        skeleton = [_skeleton(optim_state_dict) if sharder.rank == 0 else None]
        dist.broadcast_object_list(skeleton, group=sharder.pg, group_src=0)
        given_state, given_groups = skeleton[0]["state"], skeleton[0]["param_groups"]
    else:
        if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict \
                or "param_groups" not in optim_state_dict:
            raise ValueError(f"dcplan.{caller}: optim_state_dict should have 'state' and 'param_groups' "
                             "(get_optimizer_state_dict's form)")
        given_state, given_groups = optim_state_dict["state"], optim_state_dict["param_groups"]
    if len(given_groups) != len(groups):
        raise ValueError(f"dcplan.{caller}: the state dict has {len(given_groups)} param groups, the optimizer "
                         f"{len(groups)}")
    torch_state: Dict[int, Dict[str, Any]] = {}
    torch_groups = []
    index = 0
    for g, (given, infos) in enumerate(zip(given_groups, groups)):
        names = [i.name for i in infos]
        if list(given[_PARAMS]) != names:
            raise ValueError(f"dcplan.{caller}: param group {g} holds {list(given[_PARAMS])}, the optimizer's "
                             f"{names}")
        torch_groups.append({**{k: v for k, v in given.items() if k != _PARAMS},
                             _PARAMS: list(range(index, index + len(infos)))})
        for info in infos:
            entry = {}
            for key, value in given_state.get(info.name, {}).items():
                if isinstance(value, _Elementwise) or _is_full_or_dtensor(value, info):
                    if isinstance(value, _Elementwise):
                        src = optim_state_dict["state"][info.name][key] if sharder.rank == 0 else None
                        value = sharder.broadcast(src, info.shard, info.shape, value.dtype)
                    dst = torch.zeros_like(info.shard)
                    sharder.load(info, dst, value, f"state.{info.name}.{key}", caller)
                    value = dst
                elif isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                entry[key] = value
            if entry:
                torch_state[index] = entry
            index += 1
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})


@dataclasses.dataclass(frozen=True)
class _Elementwise:
    """In a broadcast skeleton: a per-element tensor that rank 0 sends next."""

    dtype: torch.dtype


def _is_full_or_dtensor(value, info) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == info.numel \
        and tuple(value.shape) == tuple(info.shape)


def _skeleton(optim_state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """optim_state_dict with its per-element (full-shape, non-scalar) tensors replaced by markers."""
    state = {}
    for name, entry in optim_state_dict["state"].items():
        state[name] = {k: _Elementwise(v.dtype) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                       for k, v in entry.items()}
    return {"state": state, "param_groups": optim_state_dict["param_groups"]}
