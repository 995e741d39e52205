#!/usr/bin/env python3
"""Measures what recording costs: per dc op (a loop of gather/wait/release on one Gloo rank,
with and without the recorder) and per training step (examples/train_llama.py on 2 ranks).

    DCPLAN_BUILD_DIR=build/rec PYTHONPATH=python python3 tests/record_e2e/measure_overhead.py

Numbers go to docs/recording.md. Each variant runs in its own process (the recorder
is armed before the runtime starts), alternately, --repeats times; the medians are
compared. Times are CPU times, so that other load on a shared machine counts little.
"""
import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def op_loop(record_dir: str, iterations: int, numel: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from dcplan import _C

    if record_dir:
        _C.record_begin(record_dir, 10**9, 0, "cpu", "cpu", {}, 1.0)
    _C.init(dist.group.WORLD.group_name)
    shard = torch.randn(numel)
    grad = torch.zeros(numel)
    _C.register_param(0, [numel], shard, grad)
    _C.register_graph_z3(0, [0])
    _C.register_graph_z3(1, [0])
    if record_dir:
        _C.record_attach()
        _C.record_add_model(3, 0, 1, "float32", "float32", [(0, "w", [numel], "float32", numel, numel, True)])
    _C.start_forward()
    token = torch.empty(0)
    ops = torch.ops.dc
    for _ in range(200):  # warm-up
        ops.release_param(ops.wait_allgather(ops.allgather_param(shard, 0, 0, None), 0, 0), 0, 0, 1)
    # CPU time of this thread: what recording adds runs here, and other load on the
    # machine does not count (Gloo's own thread does the copy, the same in both variants).
    t0 = time.thread_time()
    for _ in range(iterations):
        full = ops.allgather_param(shard, 0, 0, None)
        ops.wait_allgather(full, 0, 0)
        ops.release_param(token, 0, 0, 1)
    elapsed = time.thread_time() - t0
    print(f"{elapsed / (3 * iterations) * 1e6:.3f}")
    if record_dir:
        _C.record_stop()
    _C.cleanup()
    dist.destroy_process_group()


def run_op_loop(record: bool, iterations: int, numel: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, __file__, "--op-loop", d if record else "", "--iterations", str(iterations),
               "--numel", str(numel)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        return float(out.stdout.strip().splitlines()[-1])


def _training_cpu_seconds(record: bool, steps: int) -> float:
    """CPU seconds of both ranks (every thread) of one train_llama run."""
    import resource

    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if record:
            # Every step recorded, the trace never written: recording all the way.
            env.update(DCPLAN_RECORD=d, DCPLAN_RECORD_WARMUP="0", DCPLAN_RECORD_STEPS=str(steps + 1),
                       DCPLAN_RECORD_EXIT="0")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples/train_llama.py"), "--steps", str(steps)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def run_training(record: bool, steps: int) -> float:
    """CPU ms per step and rank: the difference of a long and a short run cancels start-up.

    CPU time rather than wall time, so that other load on the machine does not count.
    """
    short = _training_cpu_seconds(record, 5)
    long = _training_cpu_seconds(record, 5 + steps)
    return (long - short) * 1e3 / steps / 2


def ops_per_step() -> int:
    """dc ops per optimizer step of the default train_llama model (ZeRO-3), from a recorded trace."""
    import json

    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, OMP_NUM_THREADS="1", DCPLAN_RECORD=d, DCPLAN_RECORD_WARMUP="0",
                   DCPLAN_RECORD_STEPS="1", DCPLAN_RECORD_EXIT="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples/train_llama.py"), "--steps", "3"]
        subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        t = json.loads(pathlib.Path(d, "rank0.trace.json").read_text())
        return sum(len(g["events"]) for g in t["steps"][0]["graphs"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--op-loop", default=None, help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--numel", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.op_loop is not None:
        op_loop(args.op_loop, args.iterations, args.numel)
        return 0
    plain, rec = [], []
    for _ in range(args.repeats):
        plain.append(run_op_loop(False, args.iterations, args.numel))
        rec.append(run_op_loop(True, args.iterations, args.numel))
    plain_us, rec_us = statistics.median(plain), statistics.median(rec)
    print(f"per op ({args.numel}-element gather/wait/release, 1 rank, CPU time of the calling thread, median of "
          f"{args.repeats}): {plain_us:.2f} us plain, {rec_us:.2f} us recorded, overhead {rec_us - plain_us:.2f} us/op")
    n = ops_per_step()
    plain, rec = [], []
    for _ in range(args.repeats):  # interleaved, so that both see the same load
        plain.append(run_training(False, args.steps))
        rec.append(run_training(True, args.steps))
    plain_ms, rec_ms = statistics.median(plain), statistics.median(rec)
    print(f"train_llama (2 ranks, ZeRO-3, {n} dc ops/step, CPU time per step and rank, median of {args.repeats}): "
          f"{plain_ms:.2f} ms plain, {rec_ms:.2f} ms recorded, {(rec_ms - plain_ms) * 1e3 / n:.2f} us/op "
          f"({100 * (rec_ms / plain_ms - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
