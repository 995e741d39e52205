"""What a rank holds while dcplan.shard() makes a model: built on the meta device (made one module
at a time inside shard()) against built on the device first, each in its own process.

    python3 bench/gpu/meta_init_peak.py [--ranks 2] [--layers 32 --hidden 4096] [--device cpu]

Prints, per way of building, the model's and one rank's shard's fp32 size, the peak of
torch.cuda.max_memory_allocated (GPU) and the growth of the process's peak RSS (host) from just
before the model is built to after shard(), the maximum over ranks.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def build(layers: int, hidden: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def measure(how: str, layers: int, hidden: int, device: torch.device) -> None:
    import dcplan

    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss0 = peak_rss_mib()
    if how == "meta":
        with torch.device("meta"):
            model = build(layers, hidden)
        dcplan.shard(model, device=device)
    else:
        model = build(layers, hidden).to(device)
        dcplan.shard(model)
    full = sum(p.numel() for p in model.parameters()) * 4 / 2**20  # ShardParameter: the original's
    shard = sum(p.detach().numel() for p in model.parameters()) * 4 / 2**20
    gpu = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    row = torch.tensor([full, shard, gpu, peak_rss_mib() - rss0], dtype=torch.float64, device=device)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        m = torch.stack(rows).max(0).values
        print(f"| {how} | {dist.get_world_size()} | {m[0]:.0f} | {m[1]:.0f} | {m[2]:.0f} | {m[3]:.0f} |", flush=True)
    dcplan.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2, help="processes (GPUs) of each measurement")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--how", choices=("meta", "eager"), help=argparse.SUPPRESS)  # one process per way
    a = p.parse_args()
    if a.how is None:  # the driver: each way in fresh processes (peaks do not reset), meta first
        print("| built | ranks | model MiB | shard MiB | GPU peak allocated MiB | host peak RSS growth MiB |")
        print("|---|---|---|---|---|---|", flush=True)
        for how in ("meta", "eager"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(a.ranks), __file__, "--how", how, "--layers", str(a.layers),
                   "--hidden", str(a.hidden), "--device", a.device]
            subprocess.run(cmd, check=True)
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    measure(a.how, a.layers, a.hidden, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
