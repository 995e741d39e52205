"""Record mode: the DCPLAN_RECORD* environment / ``record=`` switch and the hooks' side of it.

docs/recording.md is the protocol. The recorder itself is C++ (``recorder/``,
bound as ``dcplan._C.record_*``): it observes every dc op and every
collective of the runtime, counts steps from ``start_forward`` /
``start_backward(sync)``, keeps everything in memory and writes
``rank<R>.progress`` after each recorded step. This module parses the
settings, arms the recorder before the runtime starts, registers each sharded
model's parameter table, and, at the first forward after the last recorded
step, has it calibrate and write ``rank<R>.trace.json``; then the process ends
with exit code 0 (``DCPLAN_RECORD_EXIT=1``, the default) or trains on. A step run
through ``dcplan.graphed_step`` is first captured and its replays timed on the
device (GraphTiming), which the trace keeps as ``calibration.graph_step_us``.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import pathlib
import platform
import sys
import time
from typing import Callable, List, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _C, _offload, _optimizer_calls

_VERSION = "0.1.0"
_DEFAULTS = {"DCPLAN_RECORD_STEPS": 3, "DCPLAN_RECORD_WARMUP": 2, "DCPLAN_RECORD_EXIT": 1}


@dataclasses.dataclass(frozen=True)
class Settings:
    directory: pathlib.Path
    steps: int
    warmup: int
    exit_after: bool
    calibration_seconds: float


def _env_int(name: str, minimum: int, maximum: Optional[int] = None) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return _DEFAULTS[name]
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bound = f"an integer >= {minimum}" if maximum is None else f"{minimum} or {maximum}"
        raise ValueError(f"dcplan: {name} should be {bound}, got {raw!r}")
    return value


def settings(record) -> Optional[Settings]:
    """What record= (or, when it is None, $DCPLAN_RECORD) asks for; None when recording is off.

    record: None (the environment decides), False (off), or the directory for the rank files.
    Steps, warm-up and exit come from DCPLAN_RECORD_STEPS / _WARMUP / _EXIT either way.
    """
    if record is False:
        return None
    if record is None:
        directory = os.environ.get("DCPLAN_RECORD", "")
        if not directory:
            return None
    elif isinstance(record, (str, os.PathLike)) and str(record):
        directory = os.fspath(record)
    else:
        raise ValueError(f"dcplan.shard: record should be None, False or a directory path, got {record!r}")
    calibration = os.environ.get("DCPLAN_RECORD_CALIBRATION_S", "3")
    try:
        calibration_seconds = float(calibration)
    except ValueError:
        calibration_seconds = -1.0
    if not calibration_seconds > 0:
        raise ValueError(f"dcplan: DCPLAN_RECORD_CALIBRATION_S should be a number of seconds > 0, got {calibration!r}")
    path = pathlib.Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)  # every rank may get here first
    except OSError as e:
        raise ValueError(f"dcplan: cannot create the record directory {directory} (DCPLAN_RECORD / record=): {e}")
    return Settings(
        directory=path.resolve(),
        steps=_env_int("DCPLAN_RECORD_STEPS", 1),
        warmup=_env_int("DCPLAN_RECORD_WARMUP", 0),
        exit_after=_env_int("DCPLAN_RECORD_EXIT", 0, 1) == 1,
        calibration_seconds=calibration_seconds,
    )


_active: Optional[Settings] = None
_optimizer_hook = None  # torch's global optimizer post-hook while recording
_calls: Optional[_optimizer_calls.CallRecorder] = None  # the recording's param groups, numbered (begin())
_graphed = False  # the recorded step runs through dcplan.graphed_step (mark_graphed())
_timing: Optional["GraphTiming"] = None  # every step recorded, the captured step being timed


def own_work(fn, *args):
    """fn(*args) as the recorder's own host work outside the runtime's ops, which a replay does not
    do (the hooks' saved-activation bookkeeping, the optimizer post-hook's): timed, and left out
    of the trace's host times (recorder::addOwnHostWorkNs)."""
    start = time.perf_counter_ns()
    try:
        return fn(*args)
    finally:
        _C.record_own_host_work(time.perf_counter_ns() - start)


def _note_optimizer_step(optimizer) -> None:
    # The device-lead step checks that the device had not caught up while the optimizer was issued.
    _C.record_optimizer_step_issued()
    impls, groups = _calls.of(optimizer)
    _C.record_optimizer_state(_offload.state_bytes(optimizer), impls, groups)


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    own_work(_note_optimizer_step, optimizer)


def _unhook_optimizers() -> None:
    global _optimizer_hook
    if _optimizer_hook is not None:
        _optimizer_hook.remove()
        _optimizer_hook = None


def active() -> bool:
    return _active is not None


def begin(s: Settings, device: torch.device) -> None:
    """Arms the recorder; must come before the runtime starts (_C.init wraps its transport then)."""
    global _active, _optimizer_hook, _calls, _graphed
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            versions["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            pass  # a build without NCCL: the trace just does not name its version
    else:
        name = device.type
    _C.record_begin(str(s.directory), s.steps, s.warmup, str(device), name, versions, s.calibration_seconds)
    _active = s
    _graphed = False
    _calls = _optimizer_calls.CallRecorder()
    _unhook_optimizers()
    _optimizer_hook = register_optimizer_step_post_hook(_optimizer_stepped)


def attach() -> None:
    """After the runtime started: the recorder observes its ops from now on."""
    _C.record_attach()


def add_model(stage: int, fwd_graph: int, bwd_graph: int, infos, world_size: int, param_dtype, reduce_dtype,
              compiled: bool = False) -> None:
    def name(dt):
        return str(dt or torch.float32).replace("torch.", "")

    params = [
        (i.ds_id, i.name, list(i.shape), name(i.shard.dtype), i.numel, (i.numel + world_size - 1) // world_size,
         i.trainable)
        for i in infos
    ]
    _C.record_add_model(stage, fwd_graph, bwd_graph, name(param_dtype), name(reduce_dtype or param_dtype), params,
                        compiled)


def pause(paused: bool) -> None:
    """Around a forward that is not a training micro-step (no grad: an eval forward, generate()):
    the recorder neither records it nor counts it as a step."""
    _C.record_pause(paused)


def saved_activations(forward_graph: int, saved) -> None:
    """In a recorded micro-step, by its backward's end: what its forward saved for the backward
    (_activations.Forward.report), the trace graph's saved_activations."""
    _C.record_saved_activations(forward_graph, saved)


def input_shapes(forward_graph: int, shapes) -> None:
    """A training forward's tensor input shapes: the recorded micro-step's trace graph keeps them
    (input_shapes), and the plan made from it, so that a replay can tell other inputs."""
    _C.record_input_shapes(forward_graph, shapes)


def mark_graphed() -> None:
    """The recorded script runs its step through dcplan.graphed_step: the trace says so, and
    dcplan plan plans for one CUDA graph per step."""
    global _graphed
    _graphed = True
    _C.record_graphed()


def mark_checks_collectives() -> None:
    """A replay of this job on more than one rank, in this environment, checks each collective with
    the ranks first (DCPLAN_CHECK_COLLECTIVES), which the recording does not: the trace says so, and
    dcplan plan charges the checks in a plan for more than one rank."""
    _C.record_checks_collectives()


def after_start_forward() -> None:
    """Called by the root forward pre-hook after start_forward(): finishes once every step is recorded."""
    global _active, _timing
    if _active is None or not _C.record_done():
        return
    s = _active
    _active = None
    _unhook_optimizers()
    if _graphed:
        # Calibrated now, on every rank at once and before the capture holds its memory; the
        # steps after this one capture the step and time its replays (GraphTiming), and each rank
        # writes its trace then, or at shutdown or exit where the script stops first: no
        # collective is left for those.
        _C.record_calibrate()
        _C.record_stop_observing()  # a capture refuses an op observer
        _timing = GraphTiming(s)
        atexit.register(finish_untimed, "the script ended before the captured step was timed")
        return
    _finish(s)  # from the forward pre-hook: the script's loop ends here


def _finish(s: Settings) -> None:
    _C.record_finish()  # calibration on every rank (unless done already), then this rank's trace
    if s.exit_after:
        # From a step of the training loop, so that the script ends there and torchrun sees
        # exit code 0 from every rank.
        raise SystemExit(0)


# The captured step's device time: the median of this many replays after the first (which
# uploads the graph to the device); a graph replays the same kernels every time, so a few
# suffice. The rule is dcplan check's and dcplan plan --calibrate's (_C.graph_step_us).
GRAPH_TIMED_REPLAYS = _C.GRAPH_TIMED_REPLAYS


class GraphTiming:
    """After the recorded steps of a dcplan.graphed_step, which ran uncaptured so that the
    recorder saw every op: the next calls capture the step (as they would without recording),
    and its replays are timed on the device between CUDA events (with more than one rank, a
    replay's time holds its waits for the others, as a replay log's does). Their median after the
    first (_C.graph_step_us) is the trace's calibration.graph_step_us, which dcplan plan fits the
    device-lead step's times to.
    Then the trace is written, as after an uncaptured recording."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._timed: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def replay(self, launch: Callable[[], None]) -> None:
        """launch() replays the captured step, timed; the replay that completes the rule's count
        (the first, then GRAPH_TIMED_REPLAYS) writes the trace."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        self._timed.append((start, end))
        if len(self._timed) == 1 + GRAPH_TIMED_REPLAYS:
            end.synchronize()
            us = _C.graph_step_us([a.elapsed_time(b) * 1000.0 for a, b in self._timed])
            _C.record_graph_step_us(us)
            _end_timing()
            _finish(self.settings)


def graph_timing() -> Optional[GraphTiming]:
    """The timing of a recorded graphed step's captured replays, while it runs; else None."""
    return _timing


def _end_timing() -> None:
    global _timing
    _timing = None
    atexit.unregister(finish_untimed)


def finish_untimed(why: str) -> Optional[Settings]:
    """Where a recorded graphed step's captured replays are not timed (the script shut down or
    ended first, the capture failed): this rank's trace is written without
    calibration.graph_step_us (no collective: calibrated already). Returns the recording's
    settings, None where no timing was under way."""
    timing = _timing
    if timing is None:
        return None
    _end_timing()
    # Printed, not warned: a script's warning filters must not hide it, and dcplan record shows
    # the lines that name the recorder.
    print(f"Warning: record: {why}; the trace has no calibration.graph_step_us, and dcplan plan predicts the "
          "graphed step on the device-lead step's times (docs/recording.md)", file=sys.stderr, flush=True)
    _C.record_finish()
    return timing.settings


def capture_failed(error: Exception) -> None:
    """A capture after the recorded steps failed: the trace is written without the captured
    step's time and, as an uncaptured recording would, the process ends where it ends after
    recording (DCPLAN_RECORD_EXIT); else the capture's error goes on."""
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    s = finish_untimed(f"capturing the step after the recorded ones failed ({first_line})")
    if s is not None and s.exit_after:
        raise SystemExit(0)


def stop() -> None:
    global _active, _graphed
    try:
        finish_untimed("dcplan.shutdown() came before the captured step was timed")
    finally:
        _active = None
        _graphed = False
        _unhook_optimizers()
        _C.record_stop()
