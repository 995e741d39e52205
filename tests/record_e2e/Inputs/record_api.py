"""One Gloo rank in one process: dcplan.shard(record=...) and the DCPLAN_RECORD* settings.

record_api.py SCENARIO DIR; prints one line per finding, exit code 0 unless a check failed.
"""
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import nn

import dcplan


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train(m, steps):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(steps):
        loss = m(torch.randn(3, 8)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}", flush=True)


def main():
    scenario, out = sys.argv[1], pathlib.Path(sys.argv[2])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if scenario == "argument":
        # record= names the directory (created); the environment gives steps and warm-up.
        m = dcplan.shard(model(), stage=3, record=str(out / "made"))
        # While recording, torch's global optimizer post-hook tells the recorder of each step().
        print("optimizer hook while recording", dcplan._record._optimizer_hook is not None)
        train(m, 5)  # 1 warm-up + 2 recorded + the forward that writes; EXIT=0 trains on
        print("optimizer hook after", dcplan._record._optimizer_hook is not None)
        t = json.loads((out / "made" / "rank0.trace.json").read_text())
        print("steps", len(t["steps"]), "params", [p["name"] for p in t["params"]])
        print("progress", (out / "made" / "rank0.progress").read_text().strip())
        # Once the runtime runs (started without recording), recording cannot start any more.
        dcplan.shutdown()
        m2 = dcplan.shard(model(), stage=2)
        try:
            dcplan.shard(model(), stage=2, record=str(out / "late"))
        except ValueError as e:
            print("late:", e)
        train(m2, 1)
    elif scenario == "off":
        m = dcplan.shard(model(), stage=1, record=False)  # DCPLAN_RECORD is set, record=False wins
        train(m, 5)
        print("files", sorted(p.name for p in out.iterdir()))
    elif scenario == "exit":
        m = dcplan.shard(model(), stage=3)
        train(m, 10)  # ends with SystemExit(0) at the forward after the recorded steps
        print("not reached")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
