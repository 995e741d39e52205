"""What model.parameters() yields after dcplan.shard(): this rank's flat fp32 shard, as a
parameter that tells a user's code the shape of the parameter it stands for.

Recipes group parameters by their shape: nanoGPT decays ``p.dim() >= 2``, others ``p.ndim < 2``
or ``len(p.shape) == 1``. On a flat shard every such test says "1-D", and every weight would
silently lose its weight decay. FSDP2 answers with a DTensor of the original shape; dcplan's
shard answers ``shape``, ``size()``, ``ndim``, ``dim()`` and ``numel()`` with the original
parameter's to code outside torch and dcplan. torch's own Python (optimizers, Dynamo, the
autograd and C++ kernels) and dcplan see the tensor as it is, the flat shard: that is what they
compute on. ``p.data`` and ``p.detach()`` are plain tensors of the shard's shape; ``len(p)``,
``stride()`` and indexing are the shard's too. A package outside torch that sizes state from
``p.shape`` (a third-party optimizer) sees the original shape: give it ``p.detach()``'s.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

# Callers in these packages see the shard as the tensor it is.
_INSIDE = ("torch", "dcplan")


def _user_asks() -> bool:
    """Whether the code asking (two frames up: past the property or method) is the user's."""
    try:
        module = sys._getframe(2).f_globals.get("__name__", "")
    except ValueError:  # asked from C with no Python caller: not user code
        return False
    return module.partition(".")[0] not in _INSIDE


class ShardParameter(nn.Parameter):
    """This rank's flat fp32 shard of a parameter whose original shape is ``original_shape``."""

    def __new__(cls, data: torch.Tensor, requires_grad: bool, original_shape):
        param = super().__new__(cls, data, requires_grad)
        param.original_shape = torch.Size(original_shape)
        return param

    @property
    def shape(self) -> torch.Size:
        return self.original_shape if _user_asks() else super().shape

    @property
    def ndim(self) -> int:
        return len(self.original_shape) if _user_asks() else super().ndim

    def dim(self) -> int:
        return len(self.original_shape) if _user_asks() else super().dim()

    def size(self, dim=None):
        if not _user_asks():
            return super().size() if dim is None else super().size(dim)
        return self.original_shape if dim is None else self.original_shape[dim]

    def numel(self) -> int:
        return self.original_shape.numel() if _user_asks() else super().numel()

    @property
    def data(self) -> torch.Tensor:
        return super().data

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """The runtime holds the shard's storage: new storage (model.to(dtype), to_empty, half()
        after dcplan.shard) would detach the parameter from it and train nothing, silently."""
        old = super().data
        if new.data_ptr() == old.data_ptr() and new.shape == old.shape and new.dtype == old.dtype:
            return  # model.to() to where the shard already is
        raise RuntimeError(
            f"dcplan: a shard's storage belongs to dcplan's runtime; it cannot become a {new.dtype} tensor of "
            f"{new.numel()} elements on {new.device} (model.to(), to_empty() or half() after dcplan.shard()?). "
            "Move, cast and initialise the model before dcplan.shard(); param_dtype= sets the compute dtype")

    def nelement(self) -> int:
        return self.original_shape.numel() if _user_asks() else super().nelement()

    def __repr__(self) -> str:
        return (f"dcplan shard of a parameter of shape {tuple(self.original_shape)} "
                f"(this rank's {super().numel()} elements):\n{self.detach()!r}")

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = ShardParameter(self.data.clone(memory_format=torch.preserve_format),
                                            self.requires_grad, self.original_shape)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return _rebuild, (self.data, self.requires_grad, tuple(self.original_shape))


def _rebuild(data: torch.Tensor, requires_grad: bool, original_shape) -> ShardParameter:
    return ShardParameter(data, requires_grad, original_shape)


def _register_with_torch_foreach() -> None:
    """torch's optimizers take their foreach and fused kernels by default only for the parameter
    types it lists (torch.distributed.tensor adds DTensor the same way): without this, a default
    AdamW over GPU shards would run its per-tensor loop."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for types in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if ShardParameter not in types:
            types.append(ShardParameter)


_register_with_torch_foreach()
