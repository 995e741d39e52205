"""Trains under `dcplan record` on 2 Gloo ranks; rank 1 is killed (SIGKILL) at its second step."""
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import dist_cases  # noqa: E402

import dcplan  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = dist_cases.make_model(dist_cases.Case("record-fault", 3))
dcplan.shard(model, stage=3)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(6):
    if rank == 1 and step == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    idx = torch.randint(0, 37, (2, dist_cases.SEQ))
    dist_cases.loss_fn(model, idx, idx).backward()
    opt.step()
    opt.zero_grad()
