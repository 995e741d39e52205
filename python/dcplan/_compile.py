"""Compiled replay: a sharded model's forward and backward run as torch.compile graphs with the
dc ops inside them.

``dcplan.shard(model, ..., compile=True)`` compiles ``model.forward``. Inside it, a sharded
parameter is a property of its module (``_gathering_body``, through ``_class_swap``) that Dynamo traces into the graph:
``allgather_param``, ``wait_allgather`` and ``release_param`` in forward, and through an
autograd.Function (``_GatherParam``) ``reduce_grad`` of its gradient in backward. Two Inductor
passes then make the graphs do what the eager hooks do:

* on the joint graph, the gathers are marked must-recompute, so the partitioner saves the shard
  for backward, not the gathered copy, and gathers it again there (ZeRO-3's re-gather);
* on the forward and the backward graph: the backward's gathers carry the backward graph's id,
  each gather sits right before the first use of the copy, and each release right after its
  last use (views of it included).

Ops run in the graph's order and reach the same executor, plan cursor and observer as the eager
hooks' ops, so a plan made from a trace of the compiled model replays there, and a departure from
it is caught the same way. The root's hooks (step start, backward start and end) stay eager.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from . import _class_swap

_dc = torch.ops.dc

# A release and a reduction have no users in the graph: they must not be dead-code eliminated.
for _op in (_dc.release_param.default, _dc.reduce_grad.default, _dc.end_backward.default):
    torch.fx.node.has_side_effect(_op)


class _GatherParam(torch.autograd.Function):
    """A parameter gathered for one use: its gradient goes to reduce_grad (the reduced shard
    gradient reaches ``.grad`` at end_backward, as in eager mode)."""

    @staticmethod
    def forward(ctx, shard, fwd_graph: int, bwd_graph: int, ds_id: int, dtype: Optional[torch.dtype]):
        ctx.bwd_graph = bwd_graph
        ctx.ds_id = ds_id
        full = _dc.allgather_param(shard, fwd_graph, ds_id, dtype)
        full = _dc.wait_allgather(full, fwd_graph, ds_id)
        # Placed after the copy's last use by the post-grad pass.
        return _dc.release_param(full, fwd_graph, ds_id, 1)

    @staticmethod
    def backward(ctx, grad):
        _dc.reduce_grad(grad, ctx.bwd_graph, ctx.ds_id)
        return None, None, None, None, None


def gather(state, shard: torch.Tensor, ds_id: int, recompute: bool = False) -> torch.Tensor:
    """shard's parameter, gathered for one read; recompute: in backward, on its graph."""
    if not torch.compiler.is_compiling() and not state.eager_read_warned and torch.is_grad_enabled():
        # Code between graphs (a graph break) runs eagerly: autograd saves what it reads whole,
        # as the compiled graphs never do (their backward gathers again).
        state.eager_read_warned = True
        name = next((i.name for i in state.infos if i.ds_id == ds_id), "?")  # looked up once, for the warning
        warnings.warn(f"dcplan: parameter {name} (ds_id {ds_id}) was read outside the compiled graphs (code "
                      "around a graph break runs eagerly): autograd keeps such a gathered copy until backward; "
                      "move the read "
                      "into the compiled region or remove the break", RuntimeWarning, stacklevel=3)
    graph = state.bwd_graph if recompute else state.fwd_graph
    return _GatherParam.apply(shard, graph, state.bwd_graph, ds_id, state.param_dtype)


def _gathering_body(attrs: List[str]):
    """A property per sharded parameter attribute: the gathered parameter during the model's
    forward, the shard otherwise (as the eager hooks leave it)."""

    def body(base: type) -> Dict[str, Any]:
        def make_property(name: str):
            def get(self):
                shard = self._parameters[name]
                state = self.__dict__["_dcplan_state"]
                # Outside the model's forward: the shard, unless autograd runs a checkpointed
                # region's forward again in eager code (a graph break inside it).
                recompute = state.recomputing()
                if state.forward_depth == 0 and not recompute:
                    return shard
                return gather(state, shard, self.__dict__["_dcplan_param_ids"][name], recompute)

            return property(get)

        return {name: make_property(name) for name in attrs}

    return body


def install(state, module: nn.Module, attrs: List[str], ids: List[int]) -> None:
    """Makes module's sharded parameters attrs (ds_ids ids) gather when read in a forward."""
    if "gathering" in _class_swap.swapped(module):
        raise ValueError(f"dcplan.shard: module {type(module).__name__} is already sharded for compiled replay")
    _class_swap.swap_class(module, "gathering", _gathering_body(attrs), key=tuple(sorted(attrs)))
    module.__dict__["_dcplan_param_ids"] = dict(zip(attrs, ids))
    module.__dict__["_dcplan_state"] = state


def inductor_options() -> Dict[str, Any]:
    """The Inductor options of a compiled sharded model: the two passes; no reordering for peak
    memory (the plan decides when copies live); and no buffer reuse. The runtime holds tensors
    past the op that hands them over (a gradient until its bucket is packed, a gathered copy
    while it is held), which Inductor cannot know: reusing such a buffer for another value, or
    computing in place into it, would overwrite them. Freed buffers still go back to the
    allocator, which counts the runtime's references."""
    from . import _compile_passes  # Inductor's import is slow: only where a model is compiled

    return {
        "joint_custom_pre_pass": _compile_passes.RecomputeGathers(),
        "post_grad_custom_post_pass": _compile_passes.PlaceGathers(),
        "reorder_for_peak_memory": False,
        "allow_buffer_reuse": False,
        "inplace_buffers": False,
    }


def compile_forward(model: nn.Module, settings) -> None:
    """model.forward, compiled with the dcplan passes; settings: True or torch.compile's kwargs
    (check_settings accepted them)."""
    kwargs = {} if settings is True else dict(settings)
    kwargs.pop("backend", None)
    options = dict(kwargs.pop("options", None) or {})
    options.update(inductor_options())
    model.forward = torch.compile(model.forward, backend="inductor", options=options, **kwargs)


# CUDA graphs of a region replay its device work, not the dc ops' host state (dcplan.graphed_step
# captures the whole step instead; docs/compiled.md).
_REFUSED_OPTIONS = ("triton.cudagraphs", "triton.cudagraph_trees")


def check_settings(settings) -> None:
    """dcplan.shard's compile argument, before the model is changed."""
    if settings is False or settings is True:
        return
    if not isinstance(settings, dict):
        raise ValueError(f"dcplan.shard: compile should be a bool or a dict of torch.compile arguments, "
                         f"got {type(settings).__name__}")
    known = {"fullgraph", "dynamic", "options", "backend"}
    unknown = sorted(set(settings) - known)
    if "mode" in unknown:
        raise ValueError("dcplan.shard: compile: 'mode' is not supported (its CUDA graphs, 'reduce-overhead', "
                         "cannot replay the dc ops' host state; capture the whole step with dcplan.graphed_step "
                         "instead: docs/compiled.md); pass Inductor settings in 'options'")
    if unknown:
        raise ValueError(f"dcplan.shard: compile: unknown torch.compile arguments {unknown}; expected some of "
                         f"{sorted(known)}")
    if settings.get("backend", "inductor") != "inductor":
        raise ValueError(f"dcplan.shard: compile: backend should be 'inductor', got {settings['backend']!r}")
    options = settings.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"dcplan.shard: compile: options should be a dict of Inductor settings, "
                         f"got {type(options).__name__}")
    clash = sorted(set(options) & set(inductor_options()))
    if clash:
        raise ValueError(f"dcplan.shard: compile: options {clash} are dcplan's own; leave them out")
    cuda_graphs = sorted(k for k in _REFUSED_OPTIONS if options.get(k))
    if cuda_graphs:
        raise ValueError(f"dcplan.shard: compile: options {cuda_graphs} (CUDA graphs) are not supported: a "
                         "captured region cannot replay the dc ops' host state; capture the whole step with "
                         "dcplan.graphed_step instead (docs/compiled.md)")
