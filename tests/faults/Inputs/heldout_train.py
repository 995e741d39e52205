"""A training script as a user writes it (run under torchrun on Gloo ranks): dcplan.shard, an
AdamW loop, the mean loss through dist.all_reduce for logging, the full parameters at the end,
and a plain return from main (no forced exit). `--no-shutdown`: neither dcplan.shutdown() nor
dist.destroy_process_group(), as in scripts that leave that to the interpreter's exit.

    torchrun --standalone --nproc-per-node 3 heldout_train.py STAGE [--no-shutdown]
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import dist_cases  # noqa: E402

import dcplan  # noqa: E402


def main() -> None:
    stage = int(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = dist_cases.make_model(dist_cases.Case("heldout", stage))
    dcplan.shard(model, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        idx = torch.randint(0, 37, (2 * ws, dist_cases.SEQ), generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = dist_cases.loss_fn(model, idx[mine], idx[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if rank == 0:
            print(f"step {step} loss {logged.item() / ws:.6f}", flush=True)
    full = dcplan.full_parameters(model)
    if rank == 0:
        print(f"parameters {sum(v.numel() for v in full.values())}", flush=True)
    if "--no-shutdown" not in sys.argv:
        dcplan.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
