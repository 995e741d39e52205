"""State dicts of sharded models and their optimizers: full (original shapes, loadable into the
plain model) and sharded (DTensors for torch.distributed.checkpoint, which reshards on load).

The API follows torch.distributed.checkpoint.state_dict, which FSDP2 users call:
``get_model_state_dict`` / ``set_model_state_dict``, ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` and ``StateDictOptions`` (ours, or torch's: the same fields).

Sharded form: each parameter is a DTensor of its original shape, placement Shard(0) over the
model's ranks (a 0-dim one Replicate), as FSDP2 gives it: so a checkpoint converts with DCP's
tools, loads into FSDP2 models and plain models, and reshards on load. A rank's flat shard is a
range of elements, its Shard(0) part a block of rows: where the two coincide (dim 0 divisible by
the world size) the DTensor's local tensor is a view of the shard and ``dcp.load`` writes straight
into the model; elsewhere one all-to-all per tensor moves the elements between the layouts, at
save and at load, so no rank ever holds a whole parameter.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import _C, _offload

_PARAMS = "params"


@dataclasses.dataclass
class StateDictOptions:
    """What the state dict functions produce and accept (the fields of torch's StateDictOptions).

    full_state_dict: original shapes, every element (a collective: every rank calls it);
    otherwise sharded DTensors for torch.distributed.checkpoint.
    cpu_offload: full tensors on the CPU, and only rank 0 keeps them (the others get {}).
    broadcast_from_rank0: set_*: only rank 0 passes a full state dict; the others pass {}.
    strict: set_model_state_dict: missing or unexpected keys are an error.
    flat_shards (dcplan's own): the sharded form dcplan checkpoints had before they kept the
    original shapes, each parameter a 1-D DTensor of its numel elements; to load such a
    checkpoint, then save it again (docs/checkpoints.md).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True
    flat_shards: bool = False


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
    fields = [f.name for f in dataclasses.fields(StateDictOptions) if f.name not in _DCPLAN_ONLY]
    if not all(hasattr(options, f) for f in fields):
        raise ValueError(f"dcplan.{caller}: options should be a dcplan.StateDictOptions (or torch's), "
                         f"got {type(options).__name__}")
    # torch's StateDictOptions has more fields; dcplan honours none of them, so they must be unset.
    for name, default in _TORCH_ONLY_DEFAULTS.items():
        if hasattr(options, name) and getattr(options, name) != default:
            raise ValueError(f"dcplan.{caller}: options.{name}={getattr(options, name)!r} is not supported "
                             f"(only {', '.join(fields)}); leave it at {default!r}")
    opts = StateDictOptions(**{f: bool(getattr(options, f, False)) for f in fields + list(_DCPLAN_ONLY)})
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError(f"dcplan.{caller}: broadcast_from_rank0=True needs full_state_dict=True")
    if opts.cpu_offload and not opts.full_state_dict:
        raise ValueError(f"dcplan.{caller}: cpu_offload=True needs full_state_dict=True (the sharded form's "
                         "local tensors stay where the shards are)")
    if opts.flat_shards and opts.full_state_dict:
        raise ValueError(f"dcplan.{caller}: flat_shards=True is a sharded form; it excludes full_state_dict=True")
    return opts


_DCPLAN_ONLY = ("flat_shards",)


_TORCH_ONLY_DEFAULTS = {"ignore_frozen_params": False, "keep_submodule_prefixes": True,
                        "flatten_optimizer_state_dict": False, "dsd_fqn_modifiers": "_fqn_modifiers"}


def _group(state) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(state.group_name)


def _by_shard(state) -> Dict[int, Any]:
    """id(shard) -> _ParamInfo."""
    return {id(i.shard): i for i in state.infos}


def _entries(model: nn.Module, state, caller: str) -> Dict[str, Tuple[Optional[Any], torch.Tensor]]:
    """model.state_dict()'s keys -> (the parameter's _ParamInfo, or None for a buffer; the tensor).
    Parameters are found by name (a tied one under each of its names), not by the identity of
    state_dict()'s values, which a state-dict hook may have replaced."""
    infos = _by_shard(state)
    params = {name: infos.get(id(p)) for name, p in model.named_parameters(remove_duplicate=False)}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        info = params.get(key)
        if key in params and (info is None or value is not info.shard):
            raise ValueError(f"dcplan.{caller}: state_dict() entry '{key}' is a parameter but not its dcplan shard "
                             "(a state-dict hook replaced it?); dcplan cannot tell which elements it holds")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"dcplan.{caller}: state_dict() entry '{key}' is a {type(value).__name__}, not a "
                             "tensor (extra state); dcplan's state dicts hold tensors only")
        out[key] = (info, value)
    return out


def _valid(info, rank: int, world_size: int) -> Tuple[int, int]:
    """(offset, length) of this rank's elements of info's parameter (its shard without padding)."""
    s = info.shard.numel()
    lo = min(rank * s, info.numel)
    return lo, min(lo + s, info.numel) - lo


def _rows(info, rank: int, world_size: int) -> Tuple[int, int]:
    """(first row, rows) of dim 0 that Shard(0) gives rank: torch.chunk's split, ceil(rows / world
    size) each, the last ranks fewer or none (torch's Shard.local_shard_size_and_offset)."""
    rows = info.shape[0]
    per = -(-rows // world_size)
    first = min(rank * per, rows)
    return first, min(first + per, rows) - first


def _row_elements(info, rank: int, world_size: int) -> Tuple[int, int]:
    """(offset, length) of rank's Shard(0) rows of info's parameter, in elements."""
    row = info.numel // info.shape[0] if info.shape[0] else 0
    first, rows = _rows(info, rank, world_size)
    return first * row, rows * row


def _contiguous_stride(shape) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _overlap(a: Tuple[int, int], b: Tuple[int, int]) -> int:
    return max(0, min(a[0] + a[1], b[0] + b[1]) - max(a[0], b[0]))


def _dtensor(local: torch.Tensor, mesh, placement, shape, stride):
    """A DTensor of `shape` over `mesh` whose local part is `local`, where it is: a host buffer
    (state or a master shard a plan keeps on the host) stays there, as FSDP2's CPU offload keeps
    its DTensors, instead of DTensor.from_local's copy to the mesh's device, which held all of it
    on the GPU at once during a save (1xH100: 234.5 MiB over a 349 MiB budget). dcp.save reads it
    and dcp.load writes it in place."""
    from torch.distributed.tensor import DTensor

    if local.device.type == mesh.device_type:
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)
    # As FSDP2 builds its sharded parameters (torch/distributed/fsdp/_fully_shard/_fsdp_common.py,
    # _from_local_no_grad): the spec and the constructor, which leaves the local tensor where it is.
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class _Sharder:
    """Turns a shard-shaped tensor into its full or sharded state-dict form, and back."""

    def __init__(self, state, opts: StateDictOptions):
        self.state, self.opts = state, opts
        self._masters = set(_offload.masters_of(state.infos))
        self.pg = _group(state)
        self.rank, self.world_size = self.pg.rank(), self.pg.size()
        self._mesh = None
        # On a GPU the copies out to host memory are queued: what the host reads or writes there
        # below (the state a plan keeps on the host, the master shards' host copies) is complete.
        _offload.host_copies_ready(state.infos[0].shard.device if state.infos else torch.device("cpu"))

    def shard(self, info, t: torch.Tensor) -> torch.Tensor:
        """info's shard t, or where a plan keeps it on the host, its host copy: the shard between
        steps, which the state dict reads and dcp.load and set_model_state_dict write in place."""
        return _offload.master_host(info.ds_id) if info.ds_id in self._masters else t

    @property
    def keeps_full(self) -> bool:
        """Whether this rank keeps what it gets (full form with cpu_offload: rank 0 only)."""
        return not self.opts.cpu_offload or self.rank == 0

    def mesh(self, device: torch.device):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.pg, device.type)
        return self._mesh

    def out(self, info, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t (shard-shaped, e.g. the shard or an Adam moment) in the state dict's form. t may be on the
        host (state or a master shard a plan keeps there): a collective takes it to the model's device."""
        device = info.shard.device
        if self.opts.full_state_dict:
            full = _C.all_gather_flat(t.detach().to(device))  # a collective: every rank, whatever it keeps
            if not self.keeps_full:
                return None
            full = full[: info.numel].view(info.shape)
            return full.cpu() if self.opts.cpu_offload else full.clone()
        from torch.distributed.tensor import DTensor, Replicate, Shard

        lo, n = _valid(info, self.rank, self.world_size)
        mesh = self.mesh(device)
        own = t.detach()[:n]
        if self.opts.flat_shards:
            return _dtensor(own, mesh, Shard(0), torch.Size([info.numel]), (1,))
        if not info.shape:  # 0-dim: one element, whole on every rank
            return DTensor.from_local(_C.all_gather_flat(t.detach().to(device))[:1].view(()), mesh, [Replicate()],
                                      run_check=False)
        if self._aligned(info):
            local = own  # a view: dcp.load writes straight into t (a master's host copy, where a plan keeps it)
        else:
            rows = _row_elements(info, self.rank, self.world_size)[1]
            # On the host where t is (the state dict holds every such buffer at once: counted on
            # CPU ranks as the device's memory, were it torch's).
            local = _offload.host_empty((rows,), t.dtype, device) if _offload.is_host(t) else t.new_empty(rows)
            self._exchange(info, own, local, to_rows=True)
        local = local.view((_rows(info, self.rank, self.world_size)[1],) + tuple(info.shape[1:]))
        return _dtensor(local, mesh, Shard(0), info.shape, _contiguous_stride(info.shape))

    def _aligned(self, info) -> bool:
        """Whether every rank's shard holds exactly its Shard(0) rows (the same answer on every rank)."""
        return all(_valid(info, q, self.world_size) == _row_elements(info, q, self.world_size)
                   for q in range(self.world_size))

    def _exchange(self, info, src: torch.Tensor, dst: torch.Tensor, to_rows: bool) -> None:
        """One all-to-all: src holds this rank's elements of info's parameter in one layout (shards,
        or Shard(0) rows), dst receives its elements in the other. Both layouts give the ranks
        contiguous element ranges in rank order, so what a rank sends to each other rank is one
        contiguous piece, in order."""
        ws = self.world_size
        shards = [_valid(info, q, ws) for q in range(ws)]
        rows = [_row_elements(info, q, ws) for q in range(ws)]
        have, want = (shards, rows) if to_rows else (rows, shards)
        sends = [_overlap(have[self.rank], want[q]) for q in range(ws)]
        receives = [_overlap(have[q], want[self.rank]) for q in range(ws)]
        device = info.shard.device
        if src.device == device and dst.device == device:
            dist.all_to_all_single(dst, src.contiguous(), receives, sends, group=self.pg)
            return
        # Host memory (state or a master shard a plan keeps there) on a GPU model: NCCL moves device
        # tensors only, so this one tensor goes through the device, and back.
        out = torch.empty(dst.shape, dtype=dst.dtype, device=device)
        dist.all_to_all_single(out, src.to(device).contiguous(), receives, sends, group=self.pg)
        dst.copy_(out)

    def load(self, info, dst: torch.Tensor, value, key: str, caller: str) -> None:
        """Copies value (this key's state-dict form) into dst, shard-shaped. A DTensor not
        aligned with the shards is a collective (every rank loads the same keys)."""
        from torch.distributed.tensor import DTensor

        lo, n = _valid(info, self.rank, self.world_size)
        with torch.no_grad():
            if isinstance(value, DTensor):  # its shape, placement and part: dtensor_error, checked before
                local = value.to_local().reshape(-1)
                if self.opts.flat_shards:
                    src = local
                elif not info.shape:  # Replicate: every rank has the element
                    src = local[lo:lo + n]
                elif not self._aligned(info):
                    self._exchange(info, local, dst[:n], to_rows=False)
                    src = dst
                else:
                    src = local
            else:
                src = value.detach().reshape(-1)[lo:lo + n]  # shape checked by the caller
            if src.data_ptr() != dst.data_ptr():  # else dcp.load wrote into the shard itself
                dst[:n].copy_(src)
            dst[n:].zero_()

    def dtensor_error(self, info, value, key: str, caller: str) -> Optional[str]:
        """Why DTensor value cannot load as info's key, or None: its global shape, placement,
        mesh size and this rank's part must be the sharded form's."""
        from torch.distributed.tensor import Replicate, Shard

        flat = self.opts.flat_shards
        shape = (info.numel,) if flat else tuple(info.shape)
        placements = (Replicate(),) if not shape else (Shard(0),)
        if tuple(value.shape) != shape:
            form = "flat_shards" if flat else "the model's"
            return f"dcplan.{caller}: '{key}' should be a DTensor of shape {shape} ({form}), got {tuple(value.shape)}"
        if tuple(value.placements) != placements or value.device_mesh.size() != self.world_size:
            return (f"dcplan.{caller}: '{key}' should be placed {list(placements)} over the model's "
                    f"{self.world_size} ranks, got {list(value.placements)} over {value.device_mesh.size()}")
        if flat:
            want = _valid(info, self.rank, self.world_size)[1]
        else:
            want = 1 if not info.shape else _row_elements(info, self.rank, self.world_size)[1]
        if value.to_local().numel() != want:
            return (f"dcplan.{caller}: '{key}': rank {self.rank}'s part of the DTensor has "
                    f"{value.to_local().numel()} elements, expected {want}")
        return None

    def broadcast(self, value: Optional[torch.Tensor], like: torch.Tensor, shape, dtype) -> torch.Tensor:
        """Rank 0's value (already checked: numel and type), on every rank (broadcast_from_rank0)."""
        if self.rank == 0:
            buf = value.detach().reshape(shape).to(like.device, dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=like.device)
        dist.broadcast(buf, group=self.pg, group_src=0)
        return buf

    def agree(self, error: Optional[str], payload=None):
        """Rank 0's verdict on what it was given (and payload), on every rank; every rank raises
        the same ValueError when rank 0 found a problem, before any tensor is sent."""
        box = [(error, payload) if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        error, payload = box[0]
        if error:
            raise ValueError(error if self.rank == 0 else f"{error} (found on rank 0)")
        return payload


# -- model -----------------------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, options=None) -> Dict[str, Any]:
    """The sharded model's state dict under model.state_dict()'s keys (tied parameters under each
    of their names, buffers included).

    Default: parameters as 1-D DTensors (torch.distributed.checkpoint). ``full_state_dict=True``:
    fp32 tensors of the original shapes, loadable with ``load_state_dict`` into the unsharded
    model; ``cpu_offload=True`` too: on the CPU, and only rank 0's dict has them. A collective.
    """
    caller = "get_model_state_dict"
    state = _state(model, caller)
    opts = _options(options, caller)
    sharder = _Sharder(state, opts)
    done: Dict[int, Optional[torch.Tensor]] = {}
    out: Dict[str, Any] = {}
    for key, (info, value) in _entries(model, state, caller).items():
        if info is None:  # a buffer: the same on every rank
            if sharder.keeps_full:
                # Full form: a copy, like the gathered parameters; sharded: the buffer itself, so
                # that dcp.load writes into it.
                value = value.detach()
                out[key] = value if not opts.full_state_dict else value.to("cpu", copy=True) if opts.cpu_offload \
                    else value.clone()
            continue
        if info.ds_id not in done:
            done[info.ds_id] = sharder.out(info, sharder.shard(info, value))
        if done[info.ds_id] is not None:
            out[key] = done[info.ds_id]
    return out


def set_model_state_dict(model: nn.Module, model_state_dict: Dict[str, Any], *, options=None) -> IncompatibleKeys:
    """Loads a full or sharded state dict (get_model_state_dict's, or the unsharded model's
    ``state_dict()``) into the sharded model's shards and buffers. A collective.

    Full tensors: every rank passes the whole dict, or with ``broadcast_from_rank0=True`` only
    rank 0 does (the others pass {} or None). ``strict`` (default True): a missing or unexpected
    key is a ValueError naming it. Returns (missing_keys, unexpected_keys).
    """
    caller = "set_model_state_dict"
    state = _state(model, caller)
    opts = _options(options, caller)
    sharder = _Sharder(state, opts)
    own = _entries(model, state, caller)
    given_dict = model_state_dict or {}
    if not isinstance(given_dict, dict):
        raise ValueError(f"dcplan.{caller}: model_state_dict should be a dict, got {type(given_dict).__name__}")
    given = sorted(given_dict)
    if opts.broadcast_from_rank0:
        error = _check_model_values(given_dict, own, sharder, caller) if sharder.rank == 0 else None
        given = sharder.agree(error, given)
    missing = sorted(set(own) - set(given))
    unexpected = sorted(set(given) - set(own))
    if opts.strict and (missing or unexpected):
        raise ValueError(f"dcplan.{caller}: the state dict does not match the model: missing keys {missing}, "
                         f"unexpected keys {unexpected} (pass StateDictOptions(strict=False) to load the rest)")
    if not opts.broadcast_from_rank0:
        error = _check_model_values(given_dict, own, sharder, caller)
        if error:
            raise ValueError(error)
    loaded = set()
    for key in sorted(set(own) & set(given)):
        info, dst = own[key]
        value = given_dict.get(key)
        if opts.broadcast_from_rank0:
            shape = info.shape if info is not None else dst.shape
            value = sharder.broadcast(value, dst, shape, torch.float32 if info is not None else dst.dtype)
        if info is None:
            with torch.no_grad():
                dst.copy_(value.reshape(dst.shape))
        elif info.ds_id not in loaded:  # a tied parameter: its first name loaded it
            sharder.load(info, sharder.shard(info, dst.detach()), value, key, caller)
            loaded.add(info.ds_id)
    return IncompatibleKeys(missing, unexpected)


def _check_model_values(given: Dict[str, Any], own, sharder: _Sharder, caller: str) -> Optional[str]:
    """The first value of given that cannot load into its key of the model, described; or None."""
    from torch.distributed.tensor import DTensor

    for key in sorted(set(given) & set(own)):
        info, dst = own[key]
        value = given[key]
        if isinstance(value, DTensor) and info is None:
            return f"dcplan.{caller}: '{key}' is a buffer; expected a plain tensor, got a DTensor"
        error = _value_error(key, value, info, info.shape if info is not None else dst.shape, sharder, caller)
        if error:
            return error
    return None


def _value_error(key: str, value, info, shape, sharder: _Sharder, caller: str) -> Optional[str]:
    """Why value cannot load as key (info's parameter or state, or a buffer of shape), or None:
    a tensor of the model's shape, or a DTensor of the sharded form (Sharder.dtensor_error)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return f"dcplan.{caller}: '{key}' should be a tensor, got {type(value).__name__}"
    if isinstance(value, DTensor) and info is not None:
        return sharder.dtensor_error(info, value, key, caller)
    if tuple(value.shape) != tuple(shape):
        return f"dcplan.{caller}: '{key}' should have shape {tuple(shape)} (the model's), got {tuple(value.shape)}"
    return None


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
    state-dict functions do), so that a checkpoint has tensors to load into and the state's
    per-element keys are known. Gradients the shards hold are put back afterwards."""
    if optim.state:
        return
    held = {}
    for group in optim.param_groups:
        for p in group[_PARAMS]:
            if p.requires_grad:
                held[p] = p.grad
                p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optim.param_groups]
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step()
    for group, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            group["lr"] = lr
    for p, grad in held.items():
        p.grad = grad


def _optim_context(model, optim, options, caller: str):
    """(options, the sharder, per param group its parameters' _ParamInfo), with the optimizer's
    state made if it has none yet."""
    state = _state(model, caller)
    opts = _options(options, caller)
    groups = _optim_params(state, optim, caller)
    _init_optim_state(optim)
    return opts, _Sharder(state, opts), groups


def _is_sharded_state(t, info) -> bool:
    """Whether optimizer state t is per element of the shard (Adam's moments), not a scalar (step)."""
    return _offload.is_per_element(t, info.shard)


def _per_element_keys(optim, p, info, caller: str) -> List[str]:
    """The keys of p's optimizer state that hold one value per shard element; any other tensor
    state must be a scalar (a ValueError names it otherwise)."""
    keys = []
    for key, value in optim.state.get(p, {}).items():
        if _is_sharded_state(value, info):
            keys.append(key)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise ValueError(f"dcplan.{caller}: optimizer state '{key}' of '{info.name}' has shape "
                             f"{tuple(value.shape)}: neither one value per shard element ({info.shard.numel()}) "
                             "nor a scalar; dcplan's state dicts do not support this optimizer's state")
    return keys


def get_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, *, options=None) -> Dict[str, Any]:
    """The optimizer's state dict keyed by parameter name, as torch.distributed.checkpoint's:
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``. Per-element
    state (Adam's moments) takes the parameters' form (options as get_model_state_dict's);
    scalars (``step``) are kept as they are. A fresh optimizer's state is made first (a step at
    lr 0 with zero gradients), so that DCP has tensors to load into. A collective.
    """
    caller = "get_optimizer_state_dict"
    opts, sharder, groups = _optim_context(model, optim, options, caller)
    out_state: Dict[str, Dict[str, Any]] = {}
    out_groups = []
    for group, infos in zip(optim.param_groups, groups):
        out_groups.append({**{k: v for k, v in group.items() if k != _PARAMS}, _PARAMS: [i.name for i in infos]})
        for p, info in zip(group[_PARAMS], infos):
            per_element = _per_element_keys(optim, p, info, caller)
            entry = {}
            for key, value in sorted(optim.state.get(p, {}).items()):
                if key in per_element:
                    value = sharder.out(info, value)  # a collective: every rank, whatever it keeps
                elif isinstance(value, torch.Tensor):  # a copy: the optimizer updates its own in place
                    value = value.detach().to("cpu", copy=True) if opts.cpu_offload else value.detach().clone()
                entry[key] = value
            if entry:
                out_state[info.name] = entry
    if not sharder.keeps_full:
        return {}
    return {"state": out_state, "param_groups": out_groups}


def set_optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Dict[str, Any], *,
                             options=None) -> None:
    """Loads get_optimizer_state_dict's form (full or sharded, saved on any number of ranks) into
    the optimizer: its state and its param groups' settings (lr, betas, ...). With
    ``broadcast_from_rank0=True`` only rank 0 passes it (the others {} or None). A collective."""
    caller = "set_optimizer_state_dict"
    opts, sharder, groups = _optim_context(model, optim, options, caller)
    per_element = {info.ds_id: _per_element_keys(optim, p, info, caller)
                   for group, infos in zip(optim.param_groups, groups) for p, info in zip(group[_PARAMS], infos)}
    if opts.broadcast_from_rank0:
        # The structure (names, scalars, settings) as objects, once rank 0 checked it all; then the
        # per-element tensors one by one.
        error, skeleton = None, None
        if sharder.rank == 0:
            error = _check_optim(optim_state_dict, groups, per_element, sharder, caller)
            skeleton = None if error else _skeleton(optim_state_dict, groups, per_element)
        skeleton = sharder.agree(error, skeleton)
        given_state, given_groups = skeleton["state"], skeleton["param_groups"]
    else:
        error = _check_optim(optim_state_dict, groups, per_element, sharder, caller)
        if error:
            raise ValueError(error)
        given_state, given_groups = optim_state_dict["state"], optim_state_dict["param_groups"]
    torch_state: Dict[int, Dict[str, Any]] = {}
    # Per-element state a plan keeps on the host goes to host memory one tensor at a time: through
    # torch's load_state_dict it would all be on the device at once (beyond the plan's budget). It is
    # staged there, and copied into the optimizer's host buffers once torch's load succeeded.
    params = [p for group in optim.param_groups for p in group[_PARAMS]]
    on_host: Dict[int, Dict[str, torch.Tensor]] = {}
    torch_groups = []
    index = 0
    for given, infos in zip(given_groups, groups):
        torch_groups.append({**{k: v for k, v in given.items() if k != _PARAMS},
                             _PARAMS: list(range(index, index + len(infos)))})
        for info in infos:
            entry = {}
            for key, value in sorted(given_state.get(info.name, {}).items()):
                if key in per_element[info.ds_id]:
                    if isinstance(value, _Elementwise):
                        src = optim_state_dict["state"][info.name][key] if sharder.rank == 0 else None
                        value = sharder.broadcast(src, info.shard, info.shape, value.dtype)
                    dst = torch.zeros_like(info.shard)
                    sharder.load(info, dst, value, f"state.{info.name}.{key}", caller)
                    value = dst
                    if _offload.keeps_state_on_host(params[index]):
                        # Staged in host memory of its own: the optimizer's buffers take it only
                        # once everything loaded (a failure leaves the state as it was).
                        on_host.setdefault(index, {})[key] = _offload.staging(dst).copy_(dst)
                        continue
                elif isinstance(value, torch.Tensor):
                    value = value.detach().clone()
                entry[key] = value
            if entry:
                torch_state[index] = entry
            index += 1
    optim.load_state_dict({"state": torch_state, "param_groups": torch_groups})
    for i, entries in on_host.items():
        optim.state[params[i]].update({key: _offload.host_copy(optim, params[i], key, staged)
                                       for key, staged in entries.items()})


def _check_optim(optim_state_dict, groups, per_element, sharder: _Sharder, caller: str) -> Optional[str]:
    """What is wrong with an optimizer state dict for this optimizer, or None."""
    if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict \
            or "param_groups" not in optim_state_dict:
        return (f"dcplan.{caller}: optim_state_dict should have 'state' and 'param_groups' "
                "(get_optimizer_state_dict's form)")
    given_groups = optim_state_dict["param_groups"]
    if len(given_groups) != len(groups):
        return f"dcplan.{caller}: the state dict has {len(given_groups)} param groups, the optimizer {len(groups)}"
    for g, (given, infos) in enumerate(zip(given_groups, groups)):
        names = [i.name for i in infos]
        if list(given.get(_PARAMS, [])) != names:
            return f"dcplan.{caller}: param group {g} holds {list(given.get(_PARAMS, []))}, the optimizer's {names}"
        for info in infos:
            for key, value in optim_state_dict["state"].get(info.name, {}).items():
                if key in per_element[info.ds_id]:
                    error = _value_error(f"state.{info.name}.{key}", value, info, info.shape, sharder, caller)
                    if error:
                        return error
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    return (f"dcplan.{caller}: state.{info.name}.{key} should be a scalar (the optimizer holds "
                            f"no per-element '{key}'), got shape {tuple(value.shape)}")
    return None


@dataclasses.dataclass(frozen=True)
class _Elementwise:
    """In a broadcast skeleton: a per-element tensor that rank 0 sends next."""

    dtype: torch.dtype


def _skeleton(optim_state_dict, groups, per_element) -> Dict[str, Any]:
    """optim_state_dict with its per-element tensors replaced by markers (rank 0 sends them next)."""
    keys = {info.name: per_element[info.ds_id] for infos in groups for info in infos}
    state = {}
    for name, entry in optim_state_dict["state"].items():
        state[name] = {k: _Elementwise(v.dtype) if k in keys.get(name, ()) else v for k, v in entry.items()}
    return {"state": state, "param_groups": optim_state_dict["param_groups"]}
