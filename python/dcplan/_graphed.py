"""A whole training step captured as one CUDA graph: ``dcplan.graphed_step``.

A plan fixes every decision of a step (which parameter is gathered when, which bucket
reduces where), so one step's device work is the same as the next's. The first calls of a
graphed step run it as written (warm-up: Inductor compiles, the optimizer creates its state,
the allocator settles); the next call captures it once into a CUDA graph, and from then on
every call copies its tensor arguments into the captured inputs and replays the graph: the
host issues one launch per step instead of every kernel, hook and collective.

What a step may do is what a CUDA graph allows (docs/compiled.md, "CUDA graphs"): the same
shapes every call, no host synchronisation (``.item()``, printing a tensor, a host wait of
dcplan such as ``dcplan.clip_grad_norm_``'s), a capturable optimizer (``capturable=True``;
a learning rate that changes must be a tensor). With a replay log open, the capture and each
replay are logged (ReplayTimes) for ``dcplan check``. While ``dcplan record``
records the script, the step runs as written and is not captured: the recorder observes every
op, and its device-lead step measures the device's own times, which ``dcplan plan --cuda-graph``
plans a graphed step with. The recorded calls count as warm-up; the next call captures, and a
few replays are timed for the trace (_record.GraphTiming) before it is written.
"""
from __future__ import annotations

import json
import os
import time
import warnings
import weakref
from typing import Any, Callable, List, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from . import _C, _clip, _offload, _plan, _record


_REUSE_SETTING = "graph_capture_record_stream_reuse"


def _reuse_freed_blocks(on: bool) -> bool:
    """Whether the caching allocator may reuse, within a capture, a block freed while other
    streams used it (a gathered copy: written on the gather stream, read on the compute stream),
    once the graph orders those uses before the new allocation. Without it such blocks are kept
    until the capture ends, and a captured step would hold every gathered copy at once. Returns
    whether the setting was applied (torch releases without it: False)."""
    if on and _REUSE_SETTING in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False  # the user's own choice stands
    # torch 2.11 deprecates the torch.cuda spelling for the accelerator one.
    apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        apply(f"{_REUSE_SETTING}:{on}")
    except (RuntimeError, AttributeError) as e:
        if on:
            warnings.warn(f"dcplan.graphed_step: this torch ({torch.__version__}) has no allocator setting "
                          f"{_REUSE_SETTING} ({e}); the captured step keeps every gathered copy until the step ends",
                          RuntimeWarning, stacklevel=4)
        return False
    return True


def optimizer_advice(opt: torch.optim.Optimizer) -> List[str]:
    """What a captured step would keep from opt that its user likely does not want: a learning
    rate that is a float (the graph keeps that value: a schedule must update a tensor in place),
    and an Adam or AdamW that is not fused (its capturable per-tensor kernels made a graphed step
    11 to 20 ms longer on 2xH100, docs/benchmarks.md)."""
    name = type(opt).__name__
    out = []
    for i, group in enumerate(opt.param_groups):
        lr = group.get("lr")
        if lr is not None and not isinstance(lr, torch.Tensor):
            out.append(f"{name} param group {i}: lr is the float {lr!r}, which the captured graph keeps; a "
                       "learning-rate schedule must update a tensor in place (lr=torch.tensor(...))")
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and not _clip.fused_adam(opt):
        out.append(f"{name} is not fused: torch's capturable {name} then runs per-tensor kernels, 11 to 20 ms "
                   f"a step on 2xH100 for a 0.94B model; pass fused=True (with capturable=True)")
    return out


# Every graphed step that captured its graph, until its close().
_captured_steps: "weakref.WeakSet[GraphedStep]" = weakref.WeakSet()


def release_graphs() -> None:
    """Drops the captured graph of every graphed step (GraphedStep.close), before the runtime stops
    (dcplan.shutdown(), the process's exit): destroying an NCCL communicator waits until every CUDA
    graph that captured its collectives is destroyed, so on 2 GPUs or more a process that kept its
    graphed step hung there. Each step's failure (a CUDA error the job already hit) is a warning:
    the runtime must still stop."""
    for step in list(_captured_steps):
        try:
            step.close()
        except Exception as e:  # noqa: BLE001 (whatever it is, the next step's graph and the runtime still go)
            _captured_steps.discard(step)
            warnings.warn(f"dcplan: closing a graphed step before the runtime stops failed: {e}", RuntimeWarning,
                          stacklevel=2)


class _OptimizerWatch:
    """While a step is captured: each optimizer it steps, checked once (optimizer_advice)."""

    def __init__(self):
        self.advice: List[str] = []
        self._seen: set = set()
        self._handle = register_optimizer_step_pre_hook(self._hook)

    def _hook(self, opt, args, kwargs) -> None:
        if id(opt) not in self._seen:
            self._seen.add(id(opt))
            self.advice += optimizer_advice(opt)

    def close(self) -> None:
        self._handle.remove()


class ReplayTimes:
    """With a replay log open, what ``dcplan check`` compares a graphed step with: the capture
    (``graph_capture``: its seconds, and the memory peak while it ran, which every replay's
    allocations repeat) and each replay (``graph_replay``: its device time between CUDA events
    around it, and the peak since the capture began). A replay's line is written once the next
    replay is launched (or at close()), so that the host never waits for the step it just issued."""

    def __init__(self):
        self._pending: Optional[tuple] = None  # (replay index, start event, end event) not yet logged
        self._replays = 0
        self._began = 0.0  # perf_counter at the capture's start

    @staticmethod
    def _log(line: dict) -> None:
        _C.log_replay_event(json.dumps(line))

    def capture_begins(self) -> None:
        # The allocator's peak statistic from here on is the captured step's (the replay log's
        # marks keep the run's own peak, warm-up included).
        torch.cuda.reset_peak_memory_stats()
        self._began = time.perf_counter()

    def captured(self) -> None:
        self._log({"ev": "graph_capture", "capture_s": round(time.perf_counter() - self._began, 3),
                   "peak_bytes": torch.cuda.max_memory_allocated()})

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        previous, self._pending = self._pending, (self._replays, start, end)
        self._replays += 1
        if previous is not None:
            self._write(previous)

    def flush(self) -> None:
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def _write(self, pending: tuple) -> None:
        index, start, end = pending
        end.synchronize()
        self._log({"ev": "graph_replay", "replay": index, "device_us": round(start.elapsed_time(end) * 1000, 1),
                   "peak_bytes": torch.cuda.max_memory_allocated()})


class StaticArgs:
    """The tensors of a step's arguments, held at fixed addresses: a CUDA graph reads its
    inputs from the memory it was captured with. Other values are part of the capture and
    must not change."""

    def __init__(self, args: tuple, kwargs: dict):
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._leaves: List[Any] = [leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf
                                   for leaf in leaves]

    def args(self):
        return pytree.tree_unflatten(self._leaves, self._spec)

    def load(self, args: tuple, kwargs: dict) -> None:
        """Copies the tensors of a call into the captured inputs, after checking that the call
        matches the captured one (structure, shapes, dtypes, devices, other values)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._spec:
            raise ValueError(f"dcplan.graphed_step: the arguments' structure differs from the captured call's: "
                             f"got {spec}, captured {self._spec}")
        for i, (new, old) in enumerate(zip(leaves, self._leaves)):
            if isinstance(old, torch.Tensor):
                if not isinstance(new, torch.Tensor):
                    raise ValueError(f"dcplan.graphed_step: argument leaf {i} should be a tensor, as captured, "
                                     f"got {type(new).__name__}")
                if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
                    raise ValueError(
                        f"dcplan.graphed_step: argument leaf {i} should be a {old.dtype} tensor of shape "
                        f"{tuple(old.shape)} on {old.device}, as captured (a CUDA graph has static shapes), got "
                        f"{new.dtype} {tuple(new.shape)} on {new.device}")
            elif new is not old and new != old:
                raise ValueError(f"dcplan.graphed_step: argument leaf {i} is {new!r}, captured as {old!r}: values "
                                 "other than tensors are part of the captured graph and cannot change")
        for new, old in zip(leaves, self._leaves):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


class GraphedStep:
    """``step = dcplan.graphed_step(train_step, warmup=2)``: ``step(*args)`` runs
    ``train_step(*args)``, as written for the first ``warmup`` calls, captured in a CUDA graph
    by the next, replayed from then on. Returns what ``train_step`` returns; after capture those
    are the graph's output tensors, overwritten by the next call (clone what you keep)."""

    def __init__(self, fn: Callable, warmup: int = 2, pool: Optional[tuple] = None):
        if not callable(fn):
            raise TypeError(f"dcplan.graphed_step: fn should be callable, got {type(fn).__name__}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"dcplan.graphed_step: warmup should be an int >= 1 (at least one step must run "
                             f"before capture: compilation and the optimizer's state), got {warmup!r}")
        self._fn = fn
        self._warmup = warmup
        self._pool = pool
        self._calls = 0
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: Optional[StaticArgs] = None
        self._outputs: Any = None
        self._side = None
        self._times: Optional[ReplayTimes] = None  # with a replay log open at capture

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def next_call_captures(self) -> bool:
        """Whether the next call captures the step (its warm-up calls are done; not while recording)."""
        return self._graph is None and self._calls >= self._warmup and not _record.active()

    def __call__(self, *args, **kwargs):
        if self._graph is None and _record.active():
            # The recorder observes every op, which a capture cannot: the step runs as written until
            # the trace is written (the process then ends, unless DCPLAN_RECORD_EXIT=0); the trace
            # says the step is graphed, so that its plan is for one CUDA graph.
            _record.mark_graphed()
            self._calls += 1  # a warm-up call too: it compiled, and the optimizer made its state
            with _plan.graphed_call():
                return self._run_warmup(args, kwargs)
        if self._graph is None and self._calls < self._warmup:
            self._calls += 1
            with _plan.graphed_call():
                return self._run_warmup(args, kwargs)
        if self._graph is None:
            _plan.check_graphed_plan()
            with _plan.graphed_call():
                try:
                    self._capture(args, kwargs)
                except Exception as e:
                    _record.capture_failed(e)  # writes the trace where a recording was timing it
                    raise
        self._inputs.load(args, kwargs)
        timing = _record.graph_timing()
        if timing is not None:
            timing.replay(self._replay)  # the last timed replay writes the trace (and may end the process)
        else:
            self._replay()
        self._calls += 1
        return self._outputs

    def _replay(self) -> None:
        if self._times is not None:
            self._times.replay(self._graph)
        else:
            self._graph.replay()

    def _run_warmup(self, args, kwargs):
        if not torch.cuda.is_available():
            raise RuntimeError("dcplan.graphed_step: CUDA graphs need a GPU; torch.cuda is not available")
        # As torch's whole-network capture does: warm-up on a side stream, so that state created
        # lazily (optimizer state, cuBLAS workspaces) does not sit in the capturing stream's queue.
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            out = self._fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(self._side)
        return out

    def _capture(self, args, kwargs) -> None:
        if _offload.has_masters():
            raise RuntimeError("dcplan.graphed_step: the plan keeps master shards on the host "
                               "(offload.optimizer_state[].master_bytes), which a captured step does not support "
                               "yet: plan at a budget that offloading the optimizer state alone meets, or run "
                               "the step without graphed_step")
        self._inputs = StaticArgs(args, kwargs)
        static_args, static_kwargs = self._inputs.args()
        torch.cuda.synchronize()  # begin_capture takes every earlier collective as complete
        times = ReplayTimes() if _plan.replay_log_open() else None
        if times is not None:
            times.capture_begins()
        graph = torch.cuda.CUDAGraph()
        reuse = _reuse_freed_blocks(True)
        watch = _OptimizerWatch()
        try:
            # thread_local: the runtime's watchdog thread keeps querying its (uncaptured) events.
            # On the warm-up's stream: cuBLAS keeps a workspace per stream (2 x 32 MiB on an H100),
            # which a stream of its own would allocate again for the capture, beyond the plan's peak.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._side, capture_error_mode="thread_local"):
                _C.begin_capture()
                try:
                    outputs = self._fn(*static_args, **static_kwargs)
                finally:
                    _C.end_capture()
        except Exception as e:
            if reuse:
                _reuse_freed_blocks(False)
            raise RuntimeError(
                f"dcplan.graphed_step: capturing the step failed: {e}\nA captured step must run the same shapes "
                "every call and must not synchronise the host (.item(), printing a tensor, "
                "dcplan.clip_grad_norm_(..., error_if_nonfinite=True)), "
                "its optimizer must be capturable (capturable=True), and nothing may record it "
                "(docs/compiled.md, 'CUDA graphs')") from e
        finally:
            watch.close()
        if reuse:
            _reuse_freed_blocks(False)
        for advice in watch.advice:
            warnings.warn(f"dcplan.graphed_step: {advice}", RuntimeWarning, stacklevel=3)
        self._graph = graph
        self._outputs = outputs
        _captured_steps.add(self)
        if times is not None:
            times.captured()
        self._times = times

    def close(self) -> None:
        """Drops the graph: the model may run outside it again (eagerly, or in a new graphed step)."""
        if self._graph is None:
            return
        torch.cuda.synchronize()
        if self._times is not None:
            self._times.flush()
        _captured_steps.discard(self)
        self._graph.reset()  # now, not whenever the last reference goes: NCCL waits for it (release_graphs)
        self._graph = None
        self._outputs = None
        self._inputs = None
        self._times = None
        if _C.is_initialized():  # else the runtime, and what it held for the graph, is gone already
            _C.release_capture()


def graphed_step(fn: Callable, warmup: int = 2, pool: Optional[tuple] = None) -> GraphedStep:
    """A training step of dcplan-sharded models captured as one CUDA graph (GraphedStep).

    fn runs one whole step (forward, backward, optimizer step, ``zero_grad``) on its
    arguments and returns what the caller reads afterwards (the loss as a tensor). Its first
    ``warmup`` calls run as written; the next is captured and then replayed. pool: a memory
    pool shared with other graphs (``torch.cuda.graph_pool_handle()``).
    """
    return GraphedStep(fn, warmup=warmup, pool=pool)
