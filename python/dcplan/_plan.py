"""Replay of plans: loading a plan for a sharded model, the replay log, and comparing the two.

The C++ plan cursor (replayer/src/PlanCursor.cpp) does the work: it counts the
position of every op the hooks issue, launches the planned prefetch groups,
keeps the persistent parameters gathered, flushes the planned buckets and
detects departures. This module only finds the plan (argument or
``DCPLAN_PLAN``), describes the live model to the C++ check, opens the replay
log (``DCPLAN_REPLAY_LOG``) and reads it back.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import sys
import warnings
from typing import Dict, Iterable, List, NamedTuple, Optional, Union

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree as pytree

from . import _C

ENV_PLAN = "DCPLAN_PLAN"
ENV_REPLAY_LOG = "DCPLAN_REPLAY_LOG"
ENV_BUDGET_GUARD = "DCPLAN_BUDGET_GUARD"
ON_MISMATCH = ("error", "fallback")


class BudgetGuardWarning(UserWarning):
    """The budget guard held back a planned prefetch or dropped a copy the plan keeps, to keep the plan's
    memory budget (once per process), or it cannot act (docs/replay.md)."""


class InputShapeWarning(UserWarning):
    """A training forward's inputs differ from those of the recording its plan was made from: the
    plan's predicted peak, step time and memory budget hold for the recorded inputs only."""


class PlanDepartureWarning(UserWarning):
    """The run departed from its plan; it continues with the default schedule (on_mismatch="fallback")."""


def resolve_plan(plan) -> Optional[str]:
    """The plan file to load: the argument, else $DCPLAN_PLAN, else None."""
    if plan is None:
        plan = os.environ.get(ENV_PLAN) or None
    if plan is None:
        return None
    if not isinstance(plan, (str, os.PathLike)):
        raise ValueError(f"dcplan.shard: plan should be a path (str or os.PathLike) or None, got {type(plan).__name__}")
    return os.fspath(plan)


def check_on_mismatch(on_mismatch) -> str:
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f'dcplan.shard: on_mismatch should be "error" or "fallback", got {on_mismatch!r}')
    return on_mismatch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def live_params(infos) -> List[tuple]:
    """(ds_id, name, shape, dtype, trainable) of each parameter, as the parameter signature sees them."""
    return [(i.ds_id, i.name, list(i.shape), dtype_name(i.shard.dtype), i.trainable) for i in infos]


def signature(infos, world_size: int) -> str:
    """The parameter signature (docs/formats.md) of a sharded model's parameters."""
    return _C.param_signature(live_params(infos), world_size)


def load(state, path: str, on_mismatch: str, reduce_dtype: Optional[torch.dtype]) -> Dict:
    """Checks plan file path against the sharded model behind state and makes it the schedule.

    Raises ValueError "<file>: <JSON pointer>: <what differs>" for a plan of another model,
    world size, stage or dtype, and for a file that is not a valid plan.
    """
    reduce_name = dtype_name(reduce_dtype or state.param_dtype or torch.float32)
    guard_setting = budget_guard_setting()
    before = _digest(path)
    loaded = _C.load_plan(
        path,
        live_params(state.infos),
        state.world_size,
        state.stage,
        state.fwd_graph,
        state.bwd_graph,
        reduce_name,
        state.param_dtype,
        on_mismatch,
        state.compiled,
    )
    device = state.infos[0].shard.device if state.infos else torch.device("cpu")
    check_same_plan(path, before, _digest(path), device)
    start_budget_guard(loaded, device, state.group_name, guard_setting)
    global _loaded
    _loaded = (path, bool(loaded["cuda_graph"]))
    state.plan = _loaded
    state.plan_inputs = None if loaded["input_shapes"] is None else PlannedInputs(
        loaded["input_shapes"], loaded["memory_budget_bytes"])
    state.inputs_warned = False
    return loaded


def input_shapes(args: tuple, kwargs: dict) -> List[List[int]]:
    """The shape of each tensor argument of a forward (args, then kwargs by name, each in pytree
    order): what a trace records and a replay compares (input_shapes, docs/formats.md)."""
    leaves = pytree.tree_leaves((args, dict(sorted(kwargs.items()))))
    return [list(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)]


class PlannedInputs(NamedTuple):
    """What a plan says of its recorded step's inputs (the forward graph's input_shapes)."""
    shapes: List[List[int]]
    budget_bytes: Optional[int]  # the plan's memory budget; None: made without one


def check_input_shapes(state, shapes: List[List[int]]) -> None:
    """At a training forward of a model that follows a plan: warns once (InputShapeWarning) where
    its inputs differ from the recorded step's the plan was made from."""
    planned = state.plan_inputs
    if planned is None or state.inputs_warned or shapes == planned.shapes:
        return
    state.inputs_warned = True
    promise = "its predicted peak and step time"
    if planned.budget_bytes is not None:
        promise += f", and its memory budget ({_mib(planned.budget_bytes)}),"
    live, recorded = _C.input_shapes_text(shapes), _C.input_shapes_text(planned.shapes)
    warnings.warn(
        f"dcplan.shard: this training forward's inputs have shapes {live}, and plan {state.plan[0]} was made from a "
        f"recorded step whose inputs had shapes {recorded}: {promise} hold for the recorded inputs; larger inputs "
        "hold more activation memory than it planned for. Record again with these inputs, or pad them to the "
        "recorded shapes (warned once)",
        InputShapeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, from its caller, of the first frame outside torch and dcplan:
    the line of the user's script that called the model (torch's module call path varies)."""
    inside = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def count_cpu_memory(device: torch.device) -> None:
    """On CPU ranks, counts the CPU tensors allocated from now on (the counting allocator the
    replay log and the budget guard read): called before the shards are made, so that the memory
    in use is the plan's (whose trace was counted alike)."""
    if device.type == "cpu":
        _C.run_peak_probe("cpu")


def budget_guard_setting() -> str:
    """$DCPLAN_BUDGET_GUARD: "on" (the default) or "off", which measures what the plan alone does;
    read before a plan is loaded, so that a bad value leaves nothing behind."""
    setting = os.environ.get(ENV_BUDGET_GUARD, "on")
    if setting not in ("on", "off"):
        raise ValueError(f'dcplan.shard: ${ENV_BUDGET_GUARD} should be "on" or "off", got "{setting}"')
    return setting


def start_budget_guard(loaded: Dict, device: torch.device, group_name: str, setting: str) -> None:
    """The budget guard of a plan made under a budget (docs/replay.md). It acts once the ranks have
    agreed on what they hold beyond the plan's model (agree_guard_excess), which every rank of a
    plan with a guard takes part in, whatever its setting."""
    global _guard
    forget_guard()
    budget, start = loaded["memory_budget_bytes"], loaded["guard_start_bytes"]
    if budget is None or start is None:  # the same on every rank: check_same_plan compared the files
        _C.set_budget_guard(None)
        return
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    probe = _C.run_peak_probe(str(device))
    # Where another CPU allocator hides torch's, the probe reads the resident set size: not the plan's count.
    counted = device.type != "cpu" or probe.describe().startswith("bytes of live CPU tensors")
    _C.set_budget_guard(int(budget), int(start))  # holds nothing back until the excess is agreed
    _guard = {"device": device, "probe": probe, "start": int(start), "steps": 0, "group": group_name,
              "off": setting == "off", "uncounted": not counted}

    def stepped(optimizer, args, kwargs):
        if _guard is not None:
            _guard["steps"] += 1

    _guard["hook"] = register_optimizer_step_post_hook(stepped)


def forget_guard() -> None:
    global _guard
    if _guard is not None:
        _guard["hook"].remove()
    _guard = None


def agree_guard_excess() -> None:
    """At a training forward's start, once after the first optimizer step (its state exists then, as
    in the plan's step; a step GradScaler skips does not count): every rank measures the memory it
    holds against the plan's guard.start_bytes, and the ranks take the most (one collective on the
    runtime's group, which every rank reaches at the same forward), so that the guard decides alike
    on every rank. A rank with $DCPLAN_BUDGET_GUARD=off, or whose memory cannot be counted, switches
    it off on every rank."""
    g = _guard
    if g is None or g["steps"] == 0 or not torch.is_grad_enabled() or _graphed_depth:
        return
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    mine = torch.tensor([g["probe"].in_use() - g["start"], int(g["off"]), int(g["uncounted"])],
                        dtype=torch.int64, device=g["device"])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=_resolve_process_group(g["group"]))
    excess, off, uncounted = (int(v) for v in mine.tolist())
    forget_guard()
    if uncounted:
        warnings.warn("dcplan: the budget guard is off: another CPU allocator hides torch's on a rank, so "
                      "the memory a plan counts cannot be read there", BudgetGuardWarning, stacklevel=3)
    if off or uncounted:
        if off and not g["off"]:
            warnings.warn(f"dcplan: the budget guard is off: ${ENV_BUDGET_GUARD}=off on another rank (every "
                          "rank must decide alike)", BudgetGuardWarning, stacklevel=3)
        _C.set_budget_guard(None)
        return
    _C.set_budget_guard_excess(max(0, excess))


# The plan the runtime follows (one per process), (path, made for one CUDA graph per step), and how
# many dcplan.graphed_step calls are running now: each kind of plan is refused by the other replay.
# Each sharded model keeps its own (its _ShardState.plan): a model sharded without one is not held
# to another's.
_loaded: Optional[tuple] = None
_graphed_depth = 0
# The budget guard's state on the Python side until the ranks agreed (start_budget_guard), or None.
_guard: Optional[Dict] = None


@contextlib.contextmanager
def graphed_call():
    """Inside a dcplan.graphed_step call (its warm-up, recorded or captured runs of the step)."""
    global _graphed_depth
    _graphed_depth += 1
    try:
        yield
    finally:
        _graphed_depth -= 1


def check_graphed_plan() -> None:
    """Before dcplan.graphed_step captures: the loaded plan, if any, was made for one CUDA graph."""
    if _loaded is not None and not _loaded[1]:
        raise ValueError(
            f"dcplan.graphed_step: plan {_loaded[0]} was made for a replay by the host (hooks or compiled "
            "graphs), and this step is captured in one CUDA graph; plan with dcplan plan --cuda-graph, or from a "
            "trace recorded through dcplan.graphed_step (dcplan plan then plans for the graph by itself)")


def check_forward(plan: Optional[tuple]) -> None:
    """At each forward of a sharded model whose plan is `plan` ((path, for one CUDA graph), or None):
    a plan made for one CUDA graph is refused by a training forward outside dcplan.graphed_step
    (the plan check lets a forward without grad pass; a captured step refuses any eager forward)."""
    if plan is not None and plan[1] and _graphed_depth == 0 and torch.is_grad_enabled():
        raise ValueError(
            f"dcplan.shard: plan {plan[0]} was made for one CUDA graph per step (dcplan plan --cuda-graph, or a "
            "trace recorded through dcplan.graphed_step), and this forward runs outside dcplan.graphed_step; run "
            "the step through dcplan.graphed_step, or plan from a trace of this replay without --cuda-graph")


def forget() -> None:
    """dcplan.shutdown(): no plan is loaded any more."""
    global _loaded
    _loaded = None
    forget_guard()


def _digest(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def check_same_plan(path: str, before: bytes, after: bytes, device: torch.device) -> None:
    """Every rank must follow the same plan: a file that changed while it was read, or that
    differs between the ranks (changed on disk between their loads, another file at that path
    on another host), is a ValueError on every rank. A collective over the runtime's ranks."""
    if before != after:
        raise ValueError(f"dcplan.shard: plan {path} changed on disk while it was loaded; write plans to a "
                         "new file (dcplan plan writes a temporary and renames it) and start again")
    mine = torch.frombuffer(bytearray(after), dtype=torch.uint8).to(device)
    every = _C.all_gather_flat(mine).cpu().view(-1, len(after))
    differ = [r for r in range(every.size(0)) if not torch.equal(every[r], every[_C.rank()])]
    if differ:
        raise ValueError(
            f"dcplan.shard: plan {path}: rank {_C.rank()} read sha256 {after.hex()[:16]}..., but rank(s) "
            f"{', '.join(map(str, differ))} read other contents (the file changed on disk between the ranks' "
            "loads, or they see different files); every rank must follow the same plan"
        )


def rank_path(path: str, rank: int) -> str:
    """The replay log path of one rank: "{rank}" in path is replaced, else ".rank<R>" is appended."""
    path = os.fspath(path)
    return path.replace("{rank}", str(rank)) if "{rank}" in path else f"{path}.rank{rank}"


class _StepMarks:
    """What the replay log measures at the start of each forward: the host time and the memory
    peak so far (dcplan.check_replay compares them with the plan's prediction)."""

    def __init__(self, device: torch.device):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(device)
        self.probe = _C.run_peak_probe(self.device)
        self.peak = 0

    def mark(self) -> None:
        self.peak = max(self.peak, self.probe.peak())
        # The op lines' clock (on CPU ranks less the log's own host time, log_us: docs/replay.md).
        t_us, log_us, taken_out = _C.replay_log_clock()
        line = {"ev": "mark", "t_us": t_us, "peak_bytes": self.peak, "log_us": log_us}
        if taken_out:
            line["log_taken_out"] = True
        if not torch.is_grad_enabled():
            line["grad"] = False  # an eval forward: it starts no step (dcplan/schemas/replay_log.h)
        _C.log_replay_event(json.dumps(line))


_marks: Optional[_StepMarks] = None
runtime_device = torch.device("cpu")  # set by dcplan.shard() when it starts the runtime


def _open_log(mine: str) -> None:
    global _marks
    _marks = _StepMarks(runtime_device)
    _C.set_replay_log(mine, _marks.device)


def replay_log_open() -> bool:
    """Whether this rank writes a replay log (a graphed step then logs its replays' times)."""
    return _marks is not None


def mark_step() -> None:
    """At the start of each forward of a sharded model: a mark in the replay log, if one is open."""
    if _marks is not None:
        _marks.mark()


def start_env_replay_log(rank: int) -> Optional[str]:
    """Opens the replay log named by $DCPLAN_REPLAY_LOG, if set; returns this rank's path."""
    path = os.environ.get(ENV_REPLAY_LOG)
    if not path:
        return None
    mine = rank_path(path, rank)
    _open_log(mine)
    return mine


def replay_log(path: Optional[str]) -> Optional[str]:
    """Writes this rank's replay log from now on (None stops it); returns the rank's file name.

    path may hold "{rank}"; without it ".rank<R>" is appended. The runtime must be started
    (after dcplan.shard()). The file is JSON lines, one event each (docs/replay.md).
    """
    global _marks
    if not _C.is_initialized():
        raise RuntimeError("dcplan.replay_log: the runtime is not started; call dcplan.shard() first")
    if path is None:
        _C.set_replay_log("")
        _marks = None
        return None
    mine = rank_path(path, _C.rank())
    _open_log(mine)
    return mine


def stop_marks() -> None:
    global _marks
    _marks = None


def warn_departure() -> None:
    """Warns (once per process) when the run left its plan under on_mismatch="fallback", and when
    the budget guard first held a prefetch back."""
    msg = _C.take_plan_departure()
    if msg:
        warnings.warn(msg, PlanDepartureWarning, stacklevel=3)
    held = _C.take_budget_guard_note()
    if held:
        warnings.warn(held, BudgetGuardWarning, stacklevel=3)


def read_replay_log(path: str) -> List[Dict]:
    """The events of one rank's replay log."""
    _C.flush_replay_log() if _C.is_initialized() else None
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def executions(events: Iterable[Dict]) -> List[Dict]:
    """Splits a replay log into graph executions: {"graph", "kind", "step", "sync", "events"}.

    An optimizer step ends with the backward whose start_backward has sync=true.
    """
    out: List[Dict] = []
    current: Dict[int, Dict] = {}
    phase, step, sync = None, 0, True
    for ev in events:
        kind = ev["ev"]
        if kind in ("start_forward", "start_backward"):
            if phase == "backward" and sync:
                step += 1
            phase = "forward" if kind == "start_forward" else "backward"
            sync = ev.get("sync", True)
            current = {}
            continue
        g = ev.get("graph")
        if g is None or g < 0:
            continue
        ex = current.get(g)
        if ex is None:
            ex = {"graph": g, "kind": phase, "step": step, "sync": sync, "events": []}
            current[g] = ex
            out.append(ex)
        ex["events"].append(ev)
    return out


def replay_differences(plan: Union[str, Dict], events: List[Dict], frozen: Iterable[int] = (),
                       stage: Optional[int] = None) -> List[str]:
    """How a replay log differs from its plan; [] when the run followed it exactly.

    Compared: every execution of a planned graph launched exactly the plan's prefetch groups at
    their positions; every backward that reduced flushed exactly the plan's buckets in order
    (frozen parameters left out); the parameters kept gathered at their release are the plan's
    persistent set (ZeRO-3; but at a release where the plan ends a copy before an optimizer step,
    its persistent_ends) or every parameter (ZeRO-1/2); a persistent parameter is gathered at
    most once per optimizer step. A departure in the log is a difference. What the budget guard
    held back is the plan's (a held group as launched, a dropped persistent copy gathered again):
    budget_holds lists it.
    """
    if isinstance(plan, dict):
        text, name = json.dumps(plan), "the plan"
    else:
        with open(plan) as f:
            text, name = f.read(), str(plan)
        plan = json.loads(text)
    stage = stage or plan["source"]["stage"]
    frozen = set(frozen)
    persistent = set(plan["persistent"])
    # What the plan asks of each graph, as the runtime's plan cursor follows it (one rule, in C++).
    graphs = {gid: {"backward": backward, "groups": [(pos, ids) for pos, ids in groups], "buckets": buckets,
                    "ends": set(ends)}
              for gid, backward, groups, buckets, ends in _C.followed_graphs(text, name, sorted(frozen))}
    diffs: List[str] = []
    names: Dict[str, str] = {}  # the plan line that loaded the plan has them (one opened before it has none)
    for ev in events:
        if ev["ev"] == "plan":
            names.update(ev.get("names", {}))

    def param(i: int) -> str:
        """A parameter as the runtime's messages name it."""
        return f"{names[str(i)]} (ds_id {i})" if str(i) in names else f"ds_id {i}"

    for ev in events:
        if ev["ev"] == "departure":
            diffs.append(f"departure in graph {ev['graph']} at position {ev['pos']}: expected {ev['expected']}, "
                         f"got {ev['actual']}")
    execs = executions(events)
    if not any(ex["graph"] in graphs for ex in execs):
        diffs.append("no execution of a planned graph in the log")
    gathers_per_step: Dict[tuple, int] = {}
    dropped: set = set()  # (step, ds_id) whose kept copy the budget guard dropped
    for n, ex in enumerate(execs):
        g = graphs.get(ex["graph"])
        if g is None:
            continue
        where = f"execution {n} (graph {ex['graph']}, step {ex['step']})"
        evs = ex["events"]
        got = [(e["pos"], e["ds_ids"]) for e in evs
               if e["ev"] == "prefetch" or (e["ev"] == "hold" and e.get("kind", "prefetch") == "prefetch")]
        if got != g["groups"]:
            diffs.append(f"{where}: prefetch groups {got}, the plan has {g['groups']}")
        flushes = [e["ds_ids"] for e in evs if e["ev"] == "flush"]
        reduces = stage >= 2 or ex["sync"]
        if g["backward"] and reduces:
            if flushes != g["buckets"]:
                diffs.append(f"{where}: flushed buckets {flushes}, the plan has {g['buckets']}")
        elif flushes:
            diffs.append(f"{where}: flushed {flushes} where the plan reduces nothing")
        for e in evs:
            if e["ev"] == "release":
                # A persistent copy ends in the backward before an optimizer step (sync), which makes
                # it stale, at the release the plan names (persistent_ends; PlanCursor::keepGathered).
                ends = ex["sync"] and (e["pos"], e["ds_id"]) in g["ends"]
                want_kept = stage < 3 or (e["ds_id"] in persistent and not ends)
                if e["kept"] != want_kept:
                    diffs.append(f"{where}: {param(e['ds_id'])} {'kept' if e['kept'] else 'dropped'} at its release "
                                 f"(position {e['pos']}), the plan {'keeps' if want_kept else 'drops'} it")
            elif e["ev"] in ("gather", "prefetch"):
                for i in e["ds_ids"] if e["ev"] == "gather" else e["launched"]:
                    if i in persistent:
                        key = (ex["step"], i)
                        gathers_per_step[key] = gathers_per_step.get(key, 0) + 1
            elif e["ev"] == "hold" and e.get("kind") == "keep":
                dropped.add((ex["step"], e["ds_ids"][0]))  # the budget guard's: gathered again, as it must
    for (step, i), count in sorted(gathers_per_step.items()):
        if count > 1 and (step, i) not in dropped:
            diffs.append(f"step {step}: persistent {param(i)} gathered {count} times")
    return diffs


def budget_holds(events: List[Dict]) -> List[Dict]:
    """What the runtime's budget guard held back (docs/replay.md): planned prefetch groups (``kind``
    "prefetch") and copies the plan keeps gathered, dropped at a release (``kind`` "keep"), each
    with ``step``, ``graph``, ``pos``, ``ds_ids`` (the plan's group, or the kept id), ``held`` (what
    was not gathered or not kept), ``bytes``, ``peak`` (the plan's), ``excess`` (what the ranks hold
    beyond the plan's model), ``budget`` and ``used_at``: the positions in the same execution whose
    own ops gathered a held prefetch's members."""
    holds: List[Dict] = []
    for ex in executions(events):
        waiting: Dict[int, Dict] = {}
        for e in ex["events"]:
            if e["ev"] == "hold":
                hold = dict(e, step=ex["step"], used_at=[], kind=e.get("kind", "prefetch"))
                holds.append(hold)
                if hold["kind"] == "prefetch":
                    waiting.update({i: hold for i in e["held"]})
            elif e["ev"] == "gather" and "held_at" in e:
                for i in e["ds_ids"]:
                    if i in waiting:
                        waiting.pop(i)["used_at"].append(e["pos"])
    return holds


def holds_report(name: str, holds: List[Dict]) -> List[str]:
    """Lines saying where the budget guard held prefetches back in one rank's log."""
    if not holds:
        return []
    prefetches = sum(h["kind"] == "prefetch" for h in holds)
    lines = [f"{name}: the budget guard held back {prefetches} planned prefetches and dropped "
             f"{len(holds) - prefetches} copies the plan keeps, to keep the budget of {_mib(holds[0]['budget'])}: "
             f"the ranks held {_mib(holds[0]['excess'])} beyond the plan's model at a step's start (each "
             "parameter gathered when used instead):"]
    for h in holds[:10]:
        where = f"  step {h['step']}, graph {h['graph']}, position {h['pos']}:"
        why = f"planned peak {_mib(h['peak'])} + {_mib(h['excess'])} held beyond the plan > budget"
        if h["kind"] == "keep":
            lines.append(f"{where} dropped the kept ds_id {h['held'][0]} ({_mib(h['bytes'])}): {why}")
            continue
        used = ", ".join(map(str, sorted(set(h["used_at"])))) or "none in this execution"
        lines.append(f"{where} held ds_ids {h['held']} ({_mib(h['bytes'])}): {why}; gathered at positions {used}")
    if len(holds) > 10:
        lines.append(f"  ... and {len(holds) - 10} more")
    return lines


def measured(events: List[Dict]) -> Dict:
    """What a replay log measured: ``step_us`` (the median time between the starts of optimizer
    steps, the first step left out as warm-up; None with fewer than 3 steps), ``steps`` (how many
    intervals that is) and ``peak_bytes`` (the highest memory at a forward's start, None without
    marks). Host time: on a GPU it is the step time when the loop waits for each step (a
    ``loss.item()``), as training loops do. The step rule is the one ``dcplan plan --calibrate``
    reads logs with (dcplan/schemas/replay_log.h)."""
    replays = [ev for ev in events if ev["ev"] == "graph_replay"]
    if replays:
        return _measured_graphed(events, replays)
    peak = max((ev["peak_bytes"] for ev in events if ev["ev"] == "mark"), default=None)
    step_events = _step_events(events)
    median, steps = _C.replay_steps(step_events)
    out = {"step_us": median, "steps": steps, "peak_bytes": peak}
    out.update(_log_cost(events, step_events))
    return out


def _log_cost(events: List[Dict], step_events: List[tuple]) -> Dict:
    """The replay log's own host time a step (``log_us``: the median over the steps the step rule
    times, from the step starts' marks) and whether the times leave it out (``log_taken_out``: CPU
    ranks); nothing for a log without it (older versions) or with fewer than 3 steps. step_events:
    the events' _step_events."""
    starts = set(_C.replay_step_starts(step_events))
    marks = [ev for ev in events if ev["ev"] == "mark" and "log_us" in ev and int(ev["t_us"]) in starts]
    if len(marks) < 3:
        return {}
    per_step = statistics.median(b["log_us"] - a["log_us"] for a, b in zip(marks[1:], marks[2:]))
    return {"log_us": per_step, "log_taken_out": all(m.get("log_taken_out", False) for m in marks)}


def _measured_graphed(events: List[Dict], replays: List[Dict]) -> Dict:
    """A graphed step's log (dcplan.graphed_step with the log open): ``step_us`` is the median of
    the replays' device times (CUDA events around each) after the first, which uploads the graph
    (None with fewer than ``_C.GRAPH_TIMED_REPLAYS`` after it; the rule of dcplan plan --calibrate and
    of the recorder's graph_step_us; of the last capture's replays, where the step was captured
    again), ``steps`` how many that is, ``peak_bytes`` the allocator's peak from
    the capture on, and ``warmup_peak_bytes`` the run's peak before it (the marks of its
    uncaptured steps, which must keep the budget too; eval forwards after the capture are in
    the capture's statistic)."""
    first = next(i for i, ev in enumerate(events) if ev["ev"] in ("graph_capture", "graph_replay"))
    warmup_peak = max((ev["peak_bytes"] for ev in events[:first] if ev["ev"] == "mark"), default=None)
    capture = [ev for ev in events if ev["ev"] == "graph_capture"]
    peak = max(ev["peak_bytes"] for ev in replays + capture)
    step_us, timed = _C.replay_graph_step([(ev["ev"], float(ev.get("device_us", 0.0))) for ev in events])
    return {"step_us": step_us, "steps": timed,
            "peak_bytes": peak, "warmup_peak_bytes": warmup_peak,
            "capture_s": capture[-1]["capture_s"] if capture else None}


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f} MiB"


def _ms(us) -> str:
    return "-" if us is None else f"{us / 1000:.3f} ms"


def prediction_report(plan: Dict, runs: Dict[str, Dict]) -> List[str]:
    """Lines comparing the plan's prediction with each rank's measurement, and whether a measured
    peak exceeds the plan's memory budget (the line then starts with "OVER BUDGET")."""
    pred = plan.get("predicted", {})
    budget = plan.get("options", {}).get("memory_budget_bytes")
    lines = [f"prediction of {plan.get('source', {}).get('trace', 'the plan')} against the run:",
             f"  {'':24s} {'step':>20s} {'peak memory':>20s}",
             f"  {'predicted':24s} {_ms(pred.get('step_us')):>20s} {_mib(pred.get('peak_memory_bytes')):>20s}"]
    for name, m in runs.items():
        step = _ms(m["step_us"])
        if m["step_us"] is not None and pred.get("step_us"):
            step += f" ({100 * (m['step_us'] / pred['step_us'] - 1):+.0f}%)"
        peak = _mib(m["peak_bytes"])
        if m["peak_bytes"] is not None and pred.get("peak_memory_bytes"):
            peak += f" ({100 * (m['peak_bytes'] / pred['peak_memory_bytes'] - 1):+.0f}%)"
        if "warmup_peak_bytes" not in m:
            timed = f"{m['steps']} steps timed"
        elif m["step_us"] is None:
            timed = f"fewer than {_C.GRAPH_TIMED_REPLAYS + 1} graph replays: not timed"
        else:
            timed = f"{m['steps']} graph replays timed on the device, after the first"
        lines.append(f"  {os.path.basename(name):24s} {step:>20s} {peak:>20s}  ({timed})")
    lines += _calibrate_hint(plan, runs)
    logged = {os.path.basename(name): m for name, m in runs.items() if m.get("log_us") is not None}
    if logged:
        out = all(m["log_taken_out"] for m in logged.values())
        lines.append("  the replay logs' own host time a step: " +
                     ", ".join(f"{_ms(m['log_us'])} ({name})" for name, m in logged.items()) +
                     (", left out of the steps above (CPU ranks)" if out else
                      ", inside the steps above (on a GPU it may overlap the device's work: time a run without "
                      "the log to compare steps)"))
    lines.append(f"  budget: {_mib(budget) if budget else 'none (the plan was made without --memory-budget)'}")
    for name, m in runs.items():
        if m.get("capture_s") is not None:
            lines.append(f"  {os.path.basename(name)}: captured in {m['capture_s']:.2f} s; uncaptured steps before "
                         f"it peaked at {_mib(m['warmup_peak_bytes'])}")
        for what, key in (("peak", "peak_bytes"), ("uncaptured steps' peak", "warmup_peak_bytes")):
            if budget and m.get(key) is not None and m[key] > budget:
                lines.append(f"OVER BUDGET: {name}: {what} {_mib(m[key])} > budget {_mib(budget)}")
    return lines


# How far a step may miss its prediction before the report points to --calibrate: issue 29's
# promise for a step's time (docs/planning.md).
CALIBRATE_BEYOND = 0.10


def _calibrate_hint(plan: Dict, runs: Dict[str, Dict]) -> List[str]:
    """Where a step missed the prediction by more than CALIBRATE_BEYOND, how to plan again from
    this run (a CUDA graph's too: its replays' device times fit the device's pace)."""
    predicted = plan.get("predicted", {}).get("step_us")
    timed = {name: m["step_us"] for name, m in runs.items() if m["step_us"] is not None}
    if not predicted or not any(abs(s / predicted - 1) > CALIBRATE_BEYOND for s in timed.values()):
        return []
    # The plan's own options again (its network comes with the logs' plan), so that the new plan is
    # made for the same ranks, budget and strategy.
    source, options = plan.get("source", {}), plan.get("options", {})
    args = [source.get("trace") or "TRACE", "-o", "PLAN"]
    if source.get("world_size"):
        args += ["--world-size", str(source["world_size"])]
    if options.get("memory_budget_bytes"):
        args += ["--memory-budget", str(options["memory_budget_bytes"])]
    if options.get("strategy", "optimized") != "optimized":
        args += ["--strategy", options["strategy"]]
    if options.get("bandwidth_gbps"):
        args += ["--bandwidth", f"{options['bandwidth_gbps']:g}"]
    if options.get("cuda_graph"):
        args += ["--cuda-graph"]
    fitted = "its device's pace" if options.get("cuda_graph") else "its collectives' time or its host's pace"
    return [f"  the step missed its prediction by more than {CALIBRATE_BEYOND:.0%}: `dcplan plan {' '.join(args)} "
            f"--calibrate {' '.join(timed)}` plans again from this run's {fitted} "
            "(docs/planning.md, \"Calibrated on a replay\"); the logs of three or more runs of this plan, every "
            "rank's of each, fit their median run, steadier where runs differ"]


def _last_complete_step(execs: List[Dict]) -> Optional[int]:
    steps = sorted({ex["step"] for ex in execs})
    return steps[-2] if len(steps) >= 2 else None  # the final step may be cut short by the end of the run


def _step_events(events: List[Dict]) -> List[tuple]:
    """(ev, t_us, sync, grad) of each event: what the step rule reads."""
    return [(ev["ev"], int(ev.get("t_us", 0)), bool(ev.get("sync", True)), bool(ev.get("grad", True)))
            for ev in events]


def _step_starts(events: List[Dict]) -> List[int]:
    """The host time (``t_us``) of each optimizer step's start: its first forward's mark."""
    return _C.replay_step_starts(_step_events(events))


def last_step_ops(events: List[Dict], execs: Optional[List[Dict]] = None) -> Dict[tuple, Dict]:
    """The op lines of a replay log's last complete optimizer step, by (graph, micro_step, pos);
    execs: the log's executions(), where the caller has them already."""
    execs = executions(events) if execs is None else execs
    last = _last_complete_step(execs)
    if last is None:
        return {}
    micro: Dict[int, int] = {}
    out: Dict[tuple, Dict] = {}
    for ex in execs:
        if ex["step"] != last:
            continue
        m = micro.get(ex["graph"], 0)
        micro[ex["graph"]] = m + 1
        for e in ex["events"]:
            if e["ev"] == "op":
                out[(ex["graph"], m, e["pos"])] = e
    return out


def curve_comparison(curve: Dict, events: List[Dict]) -> Dict:
    """The simulated memory of each op (``dcplan inspect PLAN --trace TRACE --memory-curve``)
    against the runtime's allocation log (the replay log's ``mem`` and, on CPU ranks, ``peak``) over
    the log's last complete optimizer step.

    Each op's measured window is the most memory in use from the previous op's issue to its own
    (``peak``; where the log has none, the bytes in use at its issue). Its prediction is the most
    the simulator holds over the same span: at the two ops before it (each after its own
    allocations; for a step's first ops, the previous step's last) and during the compute before it
    (for a step's first op, the optimizer step's). Returns ``ops`` (graph, micro_step, pos, op,
    predicted, measured), ``predicted_peak`` and ``measured_peak`` over the compared ops."""
    logged = last_step_ops(events)
    rows = []
    samples = curve["samples"]
    for k, s in enumerate(samples):
        e = logged.get((s["graph"], s["micro_step"], s["pos"]))
        if e is None or "mem" not in e:
            continue
        window = [s["before_bytes"]] + [samples[j]["at_bytes"] for j in (k - 1, k - 2)]  # j < 0: the step before
        measured_bytes = e.get("peak", e["mem"])
        rows.append((s["graph"], s["micro_step"], s["pos"], s["op"], max(window), measured_bytes))
    return {"ops": rows,
            "predicted_peak": max((r[4] for r in rows), default=None),
            "measured_peak": max((r[5] for r in rows), default=None)}


def curve_report(name: str, comparison: Dict, show: int = 5) -> List[str]:
    """Lines of curve_comparison: the peaks, and the ops the prediction misses most."""
    rows = comparison["ops"]
    if not rows:
        return [f"  {os.path.basename(name)}: no op with memory in the log's last complete step "
                "(logs of dcplan before 0.2 carry none)"]
    pred, meas = comparison["predicted_peak"], comparison["measured_peak"]
    lines = [f"  {os.path.basename(name)}: {len(rows)} ops, peak predicted {_mib(pred)}, measured {_mib(meas)} "
             f"({100 * (meas / pred - 1):+.1f}%)"]
    under = sorted((r for r in rows if r[5] > r[4]), key=lambda r: r[4] - r[5])[:show]
    for g, m, pos, op, p, mb in under:
        lines.append(f"    graph {g} micro-step {m} pos {pos} {op}: measured {_mib(mb)}, predicted {_mib(p)} "
                     f"({(mb - p) / 2**10:+.0f} KiB)")
    return lines


class OpTime(NamedTuple):
    """One op of a step: where it is, and when the host reached it from the step's start."""
    graph: int
    micro_step: int
    pos: int
    op: str
    ds_id: int
    predicted_us: float
    measured_us: float
    kind: str  # the graph's: forward or backward


def time_comparison(curve: Dict, events: List[Dict]) -> Dict:
    """The plan's simulated host time at each op (the curve's ``host_us``, from the step's start)
    against the replay log's (its op lines' ``t_us`` less the step's start mark), over the log's
    last complete optimizer step. Returns ``ops`` (an OpTime each), ``predicted_step_us``,
    ``measured_step_us`` (to the next step's start) and ``host_lane`` (the curve's times are the
    host's; without it the device's); or only ``reason``, why the two cannot be compared."""
    if "step_us" not in curve or any("host_us" not in s for s in curve["samples"]):
        return {"reason": "the curve has no op times (written by a dcplan before 2026-11-26)"}
    execs = executions(events)
    last = _last_complete_step(execs)
    starts = _step_starts(events)
    if last is None or len(starts) <= last + 1:
        return {"reason": "the log has no complete optimizer step with marks before and after it"}
    # A forward run outside training (an eval between steps) is an execution the plan's step has not:
    # its ops would stand in for the step's, and its mark for the step's start.
    micro_steps = {}
    for s in curve["samples"]:
        micro_steps[s["graph"]] = max(micro_steps.get(s["graph"], 0), s["micro_step"] + 1)
    runs = {}
    for ex in execs:
        if ex["step"] == last:
            runs[ex["graph"]] = runs.get(ex["graph"], 0) + 1
    extra = {g: n for g, n in runs.items() if n > micro_steps.get(g, 0)}
    if extra:
        g, n = next(iter(extra.items()))
        return {"reason": f"the log's step {last} runs graph {g} {n} times, the plan's step "
                          f"{micro_steps.get(g, 0)} (a forward outside training, such as an eval, between steps?)"}
    logged = last_step_ops(events, execs)
    start = starts[last]
    rows = []
    for s in curve["samples"]:
        e = logged.get((s["graph"], s["micro_step"], s["pos"]))
        if e is None:
            return {"reason": f"the log's step {last} has no op at graph {s['graph']} micro-step {s['micro_step']} "
                              f"position {s['pos']} ({s['op']}): another plan's curve, or a departure?"}
        if "t_us" not in e:
            return {"reason": "the log's op lines have no times (written by a dcplan before 2026-11-26)"}
        rows.append(OpTime(s["graph"], s["micro_step"], s["pos"], s["op"], e["ds_id"], s["host_us"],
                           e["t_us"] - start, s["kind"]))
    if not rows or not curve["step_us"] > 0:
        return {"reason": "the curve has no ops or no predicted step"}
    return {"ops": rows, "predicted_step_us": curve["step_us"], "measured_step_us": starts[last + 1] - start,
            "host_lane": curve.get("host_lane", True)}


def time_report(name: str, comparison: Dict, show: int = 3) -> List[str]:
    """Lines of time_comparison: where the step's time went, predicted against measured, and the
    stretches between two ops that the prediction misses most."""
    if "reason" in comparison:
        return [f"  {os.path.basename(name)}: op times not compared: {comparison['reason']}"]
    rows: List[OpTime] = comparison["ops"]
    first_backward = next((r for r in rows if r.kind == "backward"), None)

    def both(r: OpTime) -> str:
        return f"{r.predicted_us / 1e3:.3f} / {r.measured_us / 1e3:.3f}"

    pred_step, meas_step = comparison["predicted_step_us"], comparison["measured_step_us"]
    backward = f"first backward op {both(first_backward)}, " if first_backward else ""
    lines = [f"  {os.path.basename(name)}: ms from the step's start, predicted / measured: {backward}"
             f"last op {both(rows[-1])}, "
             f"step {pred_step / 1e3:.3f} / {meas_step / 1e3:.3f} ({100 * (meas_step / pred_step - 1):+.0f}%)"]
    if not comparison["host_lane"]:
        lines.append("    (the trace has no host times: the predicted times are the device's, the measured the host's)")
    stretches = []  # (measured - predicted, op, predicted, measured): the time since the op before
    prev_pred, prev_meas = 0.0, 0.0  # the step's start
    for r in rows:
        p, m = r.predicted_us - prev_pred, r.measured_us - prev_meas
        stretches.append((m - p, r, p, m))
        prev_pred, prev_meas = r.predicted_us, r.measured_us
    p, m = pred_step - prev_pred, meas_step - prev_meas
    stretches.append((m - p, None, p, m))  # to the next step's start
    for extra, r, p, m in sorted(stretches, key=lambda x: -abs(x[0]))[:show]:
        where = "after the last op (optimizer step, the loop)" if r is None else \
            f"before graph {r.graph} micro-step {r.micro_step} pos {r.pos} {r.op} (ds_id {r.ds_id})"
        lines.append(f"    {where}: measured {m / 1e3:.3f} ms, predicted {p / 1e3:.3f} ms ({extra / 1e3:+.3f} ms)")
    return lines + _stretch_kinds_report(rows, stretches, show)


def _stretch_kinds_report(rows: List[OpTime], stretches: List, show: int) -> List[str]:
    """The kinds of stretch (the op before -> the op, in a forward or backward graph) whose
    stretches together the prediction misses most, where a kind recurs: a miss spread over every
    gather of the step (an op's own host time off by tens of microseconds) shows there, not among
    the single stretches."""
    kinds: Dict[tuple, List[float]] = {}  # kind -> [count, predicted, measured]
    for (_, r, p, m), prev in zip(stretches, [None] + rows):
        if r is None:  # after the last op: one of its kind
            continue
        if prev is None:
            before = "the step's start"
        elif (prev.graph, prev.micro_step) != (r.graph, r.micro_step):
            before = f"the {r.kind}'s start"
        else:
            before = prev.op
        key = (r.kind, before, r.op)
        k = kinds.setdefault(key, [0, 0.0, 0.0])
        k[0] += 1
        k[1] += p
        k[2] += m
    recurring = [(key, k) for key, k in kinds.items() if k[0] > 1]
    if not recurring:
        return []
    lines = ["    by kind of stretch (the op before -> the op), where it recurs:"]
    for (kind, prev_op, op), (n, p, m) in sorted(recurring, key=lambda x: -abs(x[1][2] - x[1][1]))[:show]:
        lines.append(f"      {kind} {prev_op} -> {op}: {n} stretches, predicted {p / n:.1f} us and measured "
                     f"{m / n:.1f} us each ({(m - p) / 1e3:+.3f} ms)")
    return lines


def write_chrome_trace(path: str, plan_name: str, comparisons: Dict[str, Dict]) -> None:
    """The predicted host timeline and each rank's measured one as Chrome trace events (Perfetto,
    chrome://tracing): one process each, one slice per op from its time to the next op's, the
    step's start at 0. Written to a temporary name, then renamed."""
    events: List[Dict] = []

    def lane(pid: int, label: str, rows: List[OpTime], times: List[float], end: float) -> None:
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "host"}})
        for k, (r, t) in enumerate(zip(rows, times)):
            last = k + 1 == len(rows)
            t_next = end if last else times[k + 1]
            events.append({"name": f"{r.op} {r.ds_id}", "cat": "dc op", "ph": "X", "pid": pid, "tid": 1, "ts": t,
                           "dur": max(0.0, t_next - t),
                           "args": {"graph": r.graph, "micro_step": r.micro_step, "pos": r.pos, "ds_id": r.ds_id,
                                    "until": "the next step's start" if last else "the next op"}})

    first = next((c for c in comparisons.values() if "ops" in c), None)
    if first is None:
        reasons = "; ".join(f"{os.path.basename(n)}: {c['reason']}" for n, c in comparisons.items())
        raise ValueError(f"--chrome-trace: no log's op times compare with the curve's ({reasons})")
    lane(1, f"predicted: {os.path.basename(plan_name)}", first["ops"], [r.predicted_us for r in first["ops"]],
         first["predicted_step_us"])
    for k, (name, c) in enumerate(comparisons.items()):
        if "ops" in c:
            lane(2 + k, f"measured: {os.path.basename(name)}", c["ops"], [float(r.measured_us) for r in c["ops"]],
                 float(c["measured_step_us"]))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: Optional[List[str]] = None) -> int:
    """python -m dcplan.check_replay PLAN LOG... [--curve CURVE]: whether each rank's replay log
    followed PLAN, and its prediction against what each rank measured; exit 1 if a log departs or a
    peak exceeds the budget."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dcplan.check_replay",
        description="Did each rank follow the plan, and how did its prediction hold? Exit 0: followed "
                    "and within the budget; 1: a departure or a peak over the budget; 2: usage.")
    parser.add_argument("plan", help="the plan the run loaded")
    parser.add_argument("logs", nargs="+", metavar="REPLAY_LOG", help="the ranks' replay logs (DCPLAN_REPLAY_LOG)")
    parser.add_argument("--curve", metavar="CURVE",
                        help="the plan's simulated memory per op (dcplan inspect PLAN --trace TRACE "
                             "--memory-curve CURVE): compared op by op with each log's allocation log and "
                             "op times")
    parser.add_argument("--chrome-trace", metavar="OUT",
                        help="with --curve: write the predicted host timeline and each rank's measured one "
                             "(last complete step) as a Chrome trace, for Perfetto or chrome://tracing")
    args = parser.parse_args(argv)
    if args.chrome_trace and not args.curve:
        parser.error("--chrome-trace needs --curve CURVE (dcplan inspect PLAN --trace TRACE --memory-curve "
                     "CURVE): the predicted times come from there")
    try:
        return _check(args)
    except _BadInput as e:
        print(f"python -m dcplan.check_replay: error: {e}", file=sys.stderr)
        return 2


class _BadInput(Exception):
    """A file the check cannot read: its name and what was wrong (exit code 2, not a departure)."""


def _read(path: str, lines: bool = False):
    """A JSON file (lines=True: JSON lines), or _BadInput naming it."""
    try:
        with open(path) as f:
            if lines:
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except (OSError, ValueError) as e:
        raise _BadInput(f"{path}: {e}") from None


def _check(args) -> int:
    failed = False
    runs: Dict[str, Dict] = {}
    logs: Dict[str, List[Dict]] = {}
    plan = _read(args.plan)
    for path in args.logs:
        events = _read(path, lines=True)
        logs[path] = events
        try:
            runs[path] = measured(events)
            diffs = replay_differences(plan, events)
        except KeyError as e:
            raise _BadInput(f"{path} against {args.plan}: missing field {e} (is it a replay log of this plan?)") \
                from None
        ops = sum(e["ev"] == "op" for e in events)
        groups = sum(e["ev"] == "prefetch" for e in events)
        holds = budget_holds(events)
        flushes = sum(e["ev"] == "flush" for e in events)
        if diffs:
            failed = True
            print(f"{path}: departs from {args.plan} ({len(diffs)} differences)")
            for d in diffs[:20]:
                print(f"  {d}")
        else:
            held = f", {len(holds)} held back or dropped by the budget guard" if holds else ""
            print(f"{path}: follows {args.plan} ({ops} ops, {groups} planned prefetches{held}, {flushes} bucket "
                  "flushes)")
        for line in holds_report(path, holds):
            print(line)
    report = prediction_report(plan, runs)
    print("\n".join(report))
    if args.curve:
        curve = _read(args.curve)
        curve_name = os.path.basename(args.curve)
        print(f"memory per op ({curve_name}) against each rank's allocation log, last complete step:")
        for path, events in logs.items():
            print("\n".join(curve_report(path, curve_comparison(curve, events))))
        times = {path: time_comparison(curve, events) for path, events in logs.items()}
        print(f"host time per op ({curve_name}) against each rank's log, last complete step:")
        for path, comparison in times.items():
            print("\n".join(time_report(path, comparison)))
        if args.chrome_trace:
            try:
                write_chrome_trace(args.chrome_trace, args.plan, times)
            except ValueError as e:
                print(f"python -m dcplan.check_replay: error: {e}", file=sys.stderr)
                return 2
            print(f"wrote the predicted and measured host timelines to {args.chrome_trace}")
    return 1 if failed or any(line.startswith("OVER BUDGET") for line in report) else 0
