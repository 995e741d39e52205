"""Latency and bus bandwidth of torch.ops.dc.inference_all_reduce_ (shared memory) against
Gloo's all_reduce, on N local CPU ranks, over message sizes.

    PYTHONPATH=python python3 bench/shm_allreduce.py [--ranks 2 3 4] [--min 4K] [--max 64M] [--rounds 5]

Both ops run in the same processes on the same group, in turn over --rounds rounds (after a
barrier each); a round times enough calls to last about --round-ms; the table gives each op's
median round. Bus bandwidth is nccl-tests' definition for all-reduce: 2 (n-1)/n * bytes / time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}iB"
    return f"{n} B"


def sizes(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def time_round(fn, x, round_s: float) -> float:
    """Seconds per call: calls until round_s has passed (the same count on every rank)."""
    dist.barrier()
    fn(x)
    t0 = time.perf_counter()
    fn(x)
    one = time.perf_counter() - t0
    # Every rank must make the same number of calls: rank 0's estimate decides.
    count = torch.tensor([max(3, min(20000, int(round_s / max(one, 1e-7))))])
    dist.broadcast(count, 0)
    n = int(count.item())
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t0) / n


def worker(rank: int, ws: int, store_path: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=ws)
    import dcplan

    dcplan.init()
    shm_path = dcplan._C.local_all_reduce_path()
    modes = {"dc": torch.ops.dc.inference_all_reduce_, "gloo": dist.all_reduce}
    rows = []
    for size in sizes(args.min, args.max):
        x = torch.zeros(size // 4, dtype=torch.float32)  # sums stay finite, whatever the count
        times = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m, fn in modes.items():
                times[m].append(time_round(fn, x, args.round_ms / 1000))
        rows.append((size, {m: statistics.median(t) for m, t in times.items()}))
    if rank == 0:
        queue.put((shm_path, rows))
    dcplan.shutdown()
    dist.destroy_process_group()


def spawn_ranks(worker, ws: int, args):
    """Runs worker(rank, ws, store_path, args, queue) on ws spawned ranks; returns what rank 0 put."""
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        # A file store, not a TCP port: a port picked free here could be taken by another job
        # before rank 0 binds it.
        mp.spawn(worker, args=(ws, os.path.join(tmp, "store"), args, queue), nprocs=ws, join=True)
    return queue.get()


def bus_gbps(size: int, seconds: float, ws: int) -> float:
    return 2 * (ws - 1) / ws * size / seconds / 1e9 if ws > 1 else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--min", type=parse_size, default=4 << 10, help="smallest message (default 4K)")
    ap.add_argument("--max", type=parse_size, default=64 << 20, help="largest message (default 64M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-ms", type=float, default=50.0, help="time per round and op (default 50)")
    ap.add_argument("--require-shm", action="store_true", help="exit 1 when the dc op does not use shared memory")
    args = ap.parse_args(argv)
    if args.min < 4 or args.max < args.min:
        ap.error("--min should be at least 4 bytes and at most --max")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, float32, in-place; median of {args.rounds} rounds")
    for ws in args.ranks:
        shm_path, rows = spawn_ranks(worker, ws, args)
        print(f"\n{ws} ranks (dc op through {'shared memory' if shm_path else 'the process group'})")
        print(f"{'size':>9} | {'dc op':>10} {'busbw':>9} | {'gloo':>10} {'busbw':>9} | {'speedup':>7}")
        for size, t in rows:
            print(
                f"{human(size):>9} | {t['dc'] * 1e6:>8.1f}us {bus_gbps(size, t['dc'], ws):>6.2f}GB/s | "
                f"{t['gloo'] * 1e6:>8.1f}us {bus_gbps(size, t['gloo'], ws):>6.2f}GB/s | {t['gloo'] / t['dc']:>6.1f}x"
            )
        sys.stdout.flush()
        if args.require_shm and not shm_path:
            print(f"error: on {ws} ranks the dc op went through the process group, not shared memory", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
