"""Gradient clipping over all shards and ranks: dcplan.clip_grad_norm_, and a warning for
torch.nn.utils.clip_grad_norm_ called on shards (it would clip each rank by its own norm)."""
from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
from torch import nn

from . import _C
from ._shard_param import ShardParameter


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, optimizer: Optional[torch.optim.Optimizer] = None
                    ) -> torch.Tensor:
    """Clips the gradients of a sharded model's parameters by their norm over every shard of
    every rank, as ``torch.nn.utils.clip_grad_norm_`` does for the unsharded model, and returns
    that total norm (the same on every rank). A collective: every rank of the model calls it,
    after ``backward()`` and before ``optimizer.step()``.

    On a GPU nothing here waits for the device: the ranks' parts are combined by a collective the
    stream waits for, and the scale is applied on the device, so it runs inside a step captured by
    ``dcplan.graphed_step``. ``error_if_nonfinite=True`` reads the norm on the host, which a
    captured step cannot: it is refused there (check the returned norm after the step instead).

    ``optimizer``: a fused Adam or AdamW (``fused=True``) that applies the scale inside its next
    ``step()`` (its ``grad_scale`` input, which GradScaler feeds for fp16) instead of a pass of its
    own over every gradient here: one read and write of the gradients less per step. The gradients
    are then not yet clipped when this returns, only in the step; not with a GradScaler.
    """
    state = getattr(model, "_dcplan", None)
    if state is None:
        raise ValueError("dcplan.clip_grad_norm_: model is not sharded by dcplan.shard(); use "
                         "torch.nn.utils.clip_grad_norm_ for an unsharded model")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"dcplan.clip_grad_norm_: norm_type should be > 0 or inf, got {norm_type}")
    if error_if_nonfinite and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("dcplan.clip_grad_norm_: error_if_nonfinite=True reads the norm on the host, which a "
                           "step captured in a CUDA graph (dcplan.graphed_step) cannot; pass "
                           "error_if_nonfinite=False and check the returned norm after the step")
    if optimizer is not None:
        _check_scaling_optimizer(optimizer, state)  # before the collective: a refusal leaves nothing
    grads = [i.shard.grad for i in state.trainable_infos if i.shard.grad is not None]
    device = state.infos[0].shard.device if state.infos else torch.device("cpu")
    # This rank's part: the padding past each parameter's end holds zero gradients.
    if not grads:
        local = torch.zeros((), device=device)
    else:
        # One multi-tensor kernel for every shard's norm, as torch's clipping computes them.
        norms = torch.stack(torch._foreach_norm([g.detach() for g in grads], norm_type, dtype=torch.float32))
        local = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    # Every rank's part, in rank order; the caller's stream waits for it, the host does not.
    parts = _C.all_gather_flat(local.reshape(1).float())
    total = parts.max() if math.isinf(norm_type) else parts.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dcplan.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if optimizer is not None:
        _scale_in_step(optimizer, coef)
    elif grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


def fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """An Adam or AdamW whose every param group is fused: one kernel per step that can apply a
    grad_scale as it reads the gradients (and the graphed step's recommended optimizer)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        g.get("fused") for g in optimizer.param_groups)


def _check_scaling_optimizer(optimizer: torch.optim.Optimizer, state) -> None:
    """optimizer= must be a fused Adam(W) over this model's trainable shards alone, with no scale of
    an earlier clip_grad_norm_ still waiting for its step."""
    name = type(optimizer).__name__
    if not fused_adam(optimizer):
        raise ValueError(f"dcplan.clip_grad_norm_: optimizer= needs a fused Adam or AdamW (fused=True), whose step "
                         f"applies the scale as it reads the gradients; got {name} "
                         f"(fused={[g.get('fused') for g in optimizer.param_groups]}); leave optimizer out to "
                         "scale the gradients here")
    mine = {id(i.shard) for i in state.trainable_infos}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"dcplan.clip_grad_norm_: optimizer= steps parameters that are not this model's trainable "
                         f"shards, which its scale would clip too; leave optimizer out to scale this model's "
                         "gradients here")
    if getattr(optimizer, "_dcplan_clip_scale", None) is not None:
        raise ValueError(f"dcplan.clip_grad_norm_: {name} still holds the scale of an earlier clip_grad_norm_ that "
                         "no step has used (two models clipped into one optimizer?); call optimizer.step() "
                         "between, or leave optimizer out")
    if getattr(optimizer, "grad_scale", None) is not None:
        raise ValueError(f"dcplan.clip_grad_norm_: {name}.grad_scale is set by someone else; leave optimizer out "
                         "to scale the gradients here")


def _scale_in_step(optimizer: torch.optim.Optimizer, coef: torch.Tensor) -> None:
    """Has optimizer's next step multiply the gradients by coef: a fused Adam(W) divides them by its
    grad_scale attribute as it reads them. A step hook checks before the step that the scale is
    still ours (a GradScaler sets its own in step()) and drops it after, so a later step that was
    not clipped is not scaled."""
    optimizer.grad_scale = (1.0 / coef).float()
    optimizer._dcplan_clip_scale = optimizer.grad_scale
    if not getattr(optimizer, "_dcplan_clip_hooks", False):
        optimizer.register_step_pre_hook(_check_scale_held)
        optimizer.register_step_post_hook(_drop_scale)
        optimizer._dcplan_clip_hooks = True


def _check_scale_held(optimizer, args, kwargs) -> None:
    ours = getattr(optimizer, "_dcplan_clip_scale", None)
    if ours is not None and getattr(optimizer, "grad_scale", None) is not ours:
        optimizer._dcplan_clip_scale = None
        raise RuntimeError(f"dcplan.clip_grad_norm_(..., optimizer=...): {type(optimizer).__name__}.grad_scale was "
                           "replaced before its step (a GradScaler steps it?), which would drop the clipping; "
                           "with a GradScaler, call clip_grad_norm_ without optimizer=")


def _drop_scale(optimizer, args, kwargs) -> None:
    ours = getattr(optimizer, "_dcplan_clip_scale", None)
    if ours is not None:
        if getattr(optimizer, "grad_scale", None) is ours:
            del optimizer.grad_scale
        optimizer._dcplan_clip_scale = None


_warned = False


def _warn_on_shards(torch_clip):
    """torch.nn.utils.clip_grad_norm_, warning once when it is given dcplan shards."""

    @functools.wraps(torch_clip)
    def clip(parameters, *args, **kwargs):
        global _warned
        if not _warned:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if any(isinstance(p, ShardParameter) for p in params):
                _warned = True
                warnings.warn(
                    "torch.nn.utils.clip_grad_norm_ on dcplan shards clips each rank by the norm of its "
                    "own shards, not the model's; use dcplan.clip_grad_norm_(model, max_norm) for the "
                    "norm over every rank", UserWarning, stacklevel=2)
            parameters = params
        return torch_clip(parameters, *args, **kwargs)

    clip._dcplan_wrapped = True
    return clip


def install_warning() -> None:
    if not getattr(torch.nn.utils.clip_grad_norm_, "_dcplan_wrapped", False):
        wrapped = _warn_on_shards(torch.nn.utils.clip_grad_norm_)
        torch.nn.utils.clip_grad_norm_ = wrapped
        torch.nn.utils.clip_grad.clip_grad_norm_ = wrapped
