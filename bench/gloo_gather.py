"""An all-gather on N local Gloo ranks, as dcplan's CPU transport makes it (one broadcast per rank,
in place) against Gloo's own allgather (whose worker thread allocates a flat output of the
gathered size while it runs: docs/planning.md, memory model), over message sizes.

    PYTHONPATH=python python3 bench/gloo_gather.py [--ranks 2 3] [--min 4K] [--max 4M] [--rounds 5]

Both run in the same processes on the same group, in turn over --rounds rounds (time_round of
bench/shm_allreduce.py); the table gives each one's median round. Sizes are the gathered output's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from shm_allreduce import human, parse_size, sizes, spawn_ranks, time_round


def broadcast_rows(out: torch.Tensor) -> None:
    """What the transport does: this rank's row holds its shard; each rank broadcasts its row."""
    works = [dist.broadcast(row, src=r, async_op=True) for r, row in enumerate(out)]
    for w in works:
        w.wait()


def gloo_allgather(out: torch.Tensor) -> None:
    dist.all_gather(list(out.unbind(0)), out[dist.get_rank()])


def worker(rank: int, ws: int, store_path: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=ws)
    modes = {"broadcasts": broadcast_rows, "allgather": gloo_allgather}
    rows = []
    for size in sizes(args.min, args.max):
        out = torch.zeros(ws, size // 4 // ws)
        out[rank] = rank
        times = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m, fn in modes.items():
                times[m].append(time_round(fn, out, args.round_ms / 1000))
        assert torch.equal(out, torch.arange(ws, dtype=out.dtype)[:, None].expand_as(out)), "a row did not arrive"
        rows.append((size, {m: statistics.median(t) for m, t in times.items()}))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--min", type=parse_size, default=4 << 10, help="smallest gathered size (default 4K)")
    ap.add_argument("--max", type=parse_size, default=4 << 20, help="largest gathered size (default 4M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-ms", type=float, default=50.0, help="time per round and mode (default 50)")
    args = ap.parse_args(argv)
    if args.min < 4 * max(args.ranks) or args.max < args.min:
        ap.error("--min should hold a float32 per rank and be at most --max")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, float32; median of {args.rounds} rounds")
    for ws in args.ranks:
        rows = spawn_ranks(worker, ws, args)
        print(f"\n{ws} ranks\n{'gathered':>9} | {'broadcasts':>12} | {'allgather':>12} | {'ratio':>6}")
        for size, t in rows:
            print(f"{human(size):>9} | {t['broadcasts'] * 1e6:>10.1f}us | {t['allgather'] * 1e6:>10.1f}us | "
                  f"{t['broadcasts'] / t['allgather']:>5.2f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
