"""The two Inductor passes of a compiled sharded model (docs/compiled.md; _compile.py says what
they do for the replay). A module of their own because they subclass Inductor's CustomGraphPass:
importing Inductor takes over a second (it imports Dynamo), so dcplan imports this only when a
model is compiled, not at ``import dcplan``."""
from __future__ import annotations

import hashlib
import operator
import pathlib
from typing import List

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

_dc = torch.ops.dc
_GATHER_OPS = (_dc.allgather_param.default, _dc.wait_allgather.default, _dc.release_param.default)


def _pass_uuid(name: str) -> bytes:
    # Inductor's FX graph cache keys on this: a change to the passes must miss the cache.
    return hashlib.sha256(name.encode() + pathlib.Path(__file__).read_bytes()).digest()


def _is_gather_op(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _GATHER_OPS


class RecomputeGathers(CustomGraphPass):
    """Joint graph: gathers (and the copies functionalization put between them) are recomputed in
    backward, never saved."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if not _is_gather_op(node):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            for user in node.users:
                if user.target is torch.ops.aten.clone.default:
                    user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self):
        return _pass_uuid("recompute-gathers")


def _storage_key(node: torch.fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return torch.multiprocessing.reductions.StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _users_of_copy(wait: torch.fx.Node) -> List[torch.fx.Node]:
    """The nodes that read the gathered copy wait returns, through any view of it."""
    key = _storage_key(wait)
    seen, users, todo = {wait}, [], [wait]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.target is _dc.release_param.default:
                continue
            seen.add(user)
            users.append(user)
            user_key = _storage_key(user)
            if key is not None and user_key is not None and user_key == key:
                todo.append(user)  # a view: its readers read the copy too
    return users


class PlaceGathers(CustomGraphPass):
    """Forward and backward graphs: the backward's gathers on the backward graph id; each gather
    right before the copy's first use; each release right after its last use."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        waits = [n for n in graph.nodes if n.target is _dc.wait_allgather.default]
        bwd = _backward_graph_id(graph, waits[0].args[1]) if backward and waits else None
        # Moving gathers, waits and releases leaves the other nodes in their order: one numbering.
        order = {n: i for i, n in enumerate(graph.nodes)}
        for wait in waits:
            gather_node = wait.args[0]
            releases = [u for u in wait.users if u.target is _dc.release_param.default]
            if gather_node.target is not _dc.allgather_param.default or len(releases) != 1:
                # What _GatherParam traces, once Inductor's own passes removed functionalization's
                # copies (its pattern matcher): anything else would leave a release unplaced.
                raise RuntimeError(
                    f"dcplan compiled replay: wait_allgather of ds_id {wait.args[2]} in graph {wait.args[1]} should "
                    f"follow its allgather_param and have one release_param among its users, got "
                    f"{gather_node.target} and {len(releases)}; leave Inductor's pattern_matcher on")
            [release] = releases
            release.replace_all_uses_with(wait)
            if bwd is not None:
                for n in (gather_node, wait, release):
                    _set_args(n, (n.args[0], bwd, *n.args[2:]))
            users = _users_of_copy(wait)
            last = wait
            if users:
                first = min(users, key=order.__getitem__)
                first.prepend(gather_node)
                first.prepend(wait)
                last = max(users, key=order.__getitem__)
            token = _release_token(last, wait)
            _set_args(release, (token, *release.args[1:]))
            release.meta["val"] = token.meta["val"]  # the op returns its token
            if last.op == "output":
                last.prepend(release)
            else:
                (last if token is wait else token).append(release)

    def uuid(self):
        return _pass_uuid("place-gathers")


def _set_args(node: torch.fx.Node, args: tuple) -> None:
    """node's new args, and the example values Inductor lowers it with (strides, constants)."""
    node.args = args
    if "eager_input_vals" in node.meta:
        _, kwargs = node.meta["eager_input_vals"]
        vals = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args)
        node.meta["eager_input_vals"] = (vals, kwargs)


def _release_token(last: torch.fx.Node, wait: torch.fx.Node) -> torch.fx.Node:
    """What a release takes as its token (the runtime reads only its dtype): a floating-point
    output of the copy's last use, so that Inductor, which schedules by data dependencies, cannot
    run the release before that use; the copy itself where the last use has none."""
    candidates = [last] + [u for u in last.users if u.target is operator.getitem]
    for node in candidates:
        val = node.meta.get("val")
        if node.op != "output" and isinstance(val, torch.Tensor) and val.is_floating_point():
            return node
    return wait


def _backward_graph_id(graph: torch.fx.Graph, forward_graph_id: int) -> int:
    """The backward graph id of a model: its reduce_grad ops say it; a graph without any (no
    trainable parameter) uses the id shard() gives every model's backward, forward + 1."""
    for n in graph.nodes:
        if n.target is _dc.reduce_grad.default:
            return n.args[1]
    return forward_graph_id + 1
