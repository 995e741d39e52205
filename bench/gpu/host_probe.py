"""How fast each CPU of this machine runs the host's side of an eager step, one CPU at a time.

Why: the host paces an eager step at 1x1024 tokens, and the same plan's step varied by up to 20%
from one process to the next on one machine (docs/benchmarks.md, "1 GPU, step time, eager hooks"),
more than issue 29 allows a prediction to miss. If the CPUs differ, the CPU a process lands on
decides its step. For each CPU this process may run on, pinned to it alone: a pure-Python loop
(the interpreter's speed) and a stretch of small kernel launches (the host's cost of one launch,
what an eager step is made of). Medians of --repeats; prints a table, and --json writes it.

    python bench/gpu/host_probe.py [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

LOOP = 300_000  # Python additions a probe runs: about 10 ms on a 2026 server core
LAUNCHES = 2_000  # kernels a launch probe queues: small enough that the queue never fills


def python_loop_ms() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i
    return (time.perf_counter() - start) * 1e3


def launch_us(x: torch.Tensor) -> float:
    """The host's time per launch of LAUNCHES one-element adds, the device drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / LAUNCHES * 1e6


def probe(cpu: int, repeats: int, x) -> dict:
    os.sched_setaffinity(0, {cpu})
    python_loop_ms()  # the first run after a move pays for cold caches
    row = {"cpu": cpu, "python_ms": statistics.median(python_loop_ms() for _ in range(repeats))}
    if x is not None:
        launch_us(x)
        row["launch_us"] = statistics.median(launch_us(x) for _ in range(repeats))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="probes per CPU; the median is kept")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    x = torch.zeros(1, device="cuda") if torch.cuda.is_available() else None
    rows = [probe(cpu, args.repeats, x) for cpu in cpus]
    os.sched_setaffinity(0, set(cpus))
    print(f"{'cpu':>4} {'python loop ms':>15} {'launch us':>10}")
    for r in rows:
        print(f"{r['cpu']:>4} {r['python_ms']:>15.2f} {r.get('launch_us', float('nan')):>10.2f}")
    for key in ("python_ms", "launch_us"):
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"{key}: fastest {min(values):.2f}, slowest {max(values):.2f} "
                  f"({(max(values) / min(values) - 1) * 100:+.1f}%), median {statistics.median(values):.2f}")
    order = sorted(rows, key=lambda r: r.get("launch_us", r["python_ms"]))
    print("by launch cost, fastest first:", ",".join(str(r["cpu"]) for r in order))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "order": [r["cpu"] for r in order]}, f, indent=1)


if __name__ == "__main__":
    main()
