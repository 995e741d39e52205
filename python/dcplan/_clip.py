"""Gradient clipping over all shards and ranks: dcplan.clip_grad_norm_, and a warning for
torch.nn.utils.clip_grad_norm_ called on shards (it would clip each rank by its own norm)."""
from __future__ import annotations

import functools
import math
import warnings

import torch
from torch import nn

from . import _C
from ._shard_param import ShardParameter


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clips the gradients of a sharded model's parameters by their norm over every shard of
    every rank, as ``torch.nn.utils.clip_grad_norm_`` does for the unsharded model, and returns
    that total norm (the same on every rank). A collective: every rank of the model calls it,
    after ``backward()`` and before ``optimizer.step()``.

    On a GPU nothing here waits for the device: the ranks' parts are combined by a collective the
    stream waits for, and the scale is applied on the device, so it runs inside a step captured by
    ``dcplan.graphed_step``. ``error_if_nonfinite=True`` reads the norm on the host, which a
    captured step cannot: it is refused there (check the returned norm after the step instead).
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
    grads = [i.shard.grad for i in state.trainable_infos if i.shard.grad is not None]
    device = state.infos[0].shard.device if state.infos else torch.device("cpu")
    # This rank's part: the padding past each parameter's end holds zero gradients.
    if not grads:
        local = torch.zeros((), device=device)
    elif math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max() for g in grads]).max().float()
    else:
        local = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32)
                             for g in grads]).pow(norm_type).sum()
    # Every rank's part, in rank order; the caller's stream waits for it, the host does not.
    parts = _C.all_gather_flat(local.reshape(1).float())
    total = parts.max() if math.isinf(norm_type) else parts.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"dcplan.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total


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
