"""How a torch optimizer runs over the dcplan shards it steps: the trace's params[].optimizer_impl
("for_loop", "foreach" or "fused") and params[].optimizer_group (the param group, numbered over
the recorded optimizers). A foreach or fused optimizer makes one call per param group, whose
temporaries grow with what it steps (a foreach AdamW's: an fp32 copy of it); a loop's are one
parameter's. The planner scales a grouped (offload) step's temporaries by them
(docs/planning.md, "Offload")."""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch

# Torch's optimizers whose choice, where a param group leaves foreach and fused open, is decided
# here as torch decides it; value: whether a tensor lr without capturable turns foreach off.
_DEFAULT_DECIDED = {torch.optim.Adam: True, torch.optim.AdamW: True, torch.optim.SGD: False}


def _default_is_foreach(optimizer: torch.optim.Optimizer, group: dict) -> Optional[bool]:
    """Torch's foreach default for `group` (Adam, AdamW and SGD, torch 2.11-2.14); None: not known."""
    tensor_lr_rule = _DEFAULT_DECIDED.get(type(optimizer))
    if tensor_lr_rule is None:
        return None  # another optimizer may decide otherwise (Adafactor runs its loop)
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch that moved it: not known rather than a failed recording
        return None
    params = [p for p in group["params"] if p.grad is not None] or list(group["params"])
    differentiable = group.get("differentiable", False) if tensor_lr_rule else False
    foreach = _default_to_fused_or_foreach(params, differentiable, use_fused=False)[1]
    if foreach and tensor_lr_rule and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
        foreach = False
    return foreach


def _impl(optimizer: torch.optim.Optimizer, group: dict) -> Optional[str]:
    if "foreach" not in group and "fused" not in group:
        return None  # an optimizer without those options
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if fused is None and foreach is None:
        default = _default_is_foreach(optimizer, group)
        return None if default is None else "foreach" if default else "for_loop"
    return "for_loop"


class CallRecorder:
    """Numbers the param groups of the optimizers a recording sees, in the order first stepped."""

    def __init__(self):
        # optimizer -> {param group index: number}; weakly keyed: a new optimizer at a freed one's
        # address gets numbers of its own.
        self._numbers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Dict[int, int]]" = weakref.WeakKeyDictionary()
        self._count = 0

    def of(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[int, str], Dict[int, int]]:
        """By ds_id of each dcplan shard `optimizer` steps: how it runs (where known), and its
        param group's number."""
        impls, groups = {}, {}
        numbers = self._numbers.setdefault(optimizer, {})
        for index, group in enumerate(optimizer.param_groups):
            impl = _impl(optimizer, group)
            if index not in numbers:
                numbers[index] = self._count
                self._count += 1
            number = numbers[index]
            for p in group["params"]:
                ds_id = getattr(p, "_dcplan_ds_id", None)
                if ds_id is None:
                    continue
                groups[ds_id] = number
                if impl is not None:
                    impls[ds_id] = impl
        return impls, groups
