"""One rank of the record -> plan -> replay pipeline (run under torch.distributed.run on Gloo).

train_tiny.py STAGE STEPS OUT [PLAN]: trains the tiny transformer of the runtime tests with
dcplan.shard(stage=STAGE[, plan=PLAN]); rank 0 writes OUT/losses<suffix>.json with the losses
and the full parameters' sums. Recording, when on, comes from DCPLAN_RECORD (dcplan record);
the replay log from DCPLAN_REPLAY_LOG. TINY_ROWS (default dist_cases.BATCH / world size): the
sequences per rank, so that a replay can run inputs of other shapes than its recording.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import dist_cases  # noqa: E402

import dcplan  # noqa: E402


def main():
    stage, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    plan = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    case = dist_cases.Case("e2e", stage)
    model = dist_cases.make_model(case)
    # ReLU for GELU: under recording, GELU's CPU kernel trips the recorder's counting allocator
    # (raw_allocate asserts on its DataPtr context), a recorder limitation reported separately.
    model.block.mlp[1] = torch.nn.ReLU()
    dcplan.shard(model, stage=stage, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    per = int(os.environ.get("TINY_ROWS", dist_cases.BATCH // ws))
    losses = []
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        idx = torch.randint(0, 37, (per * ws, dist_cases.SEQ), generator=g)
        tgt = torch.randint(0, 37, (per * ws, dist_cases.SEQ), generator=g)
        mine = slice(rank * per, (rank + 1) * per)
        loss = dist_cases.loss_fn(model, idx[mine], tgt[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    full = dcplan.full_parameters(model)
    if rank == 0:
        name = "losses-plan.json" if plan else "losses.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump({"losses": losses, "params": {k: v.double().sum().item() for k, v in full.items()}}, f)
    dcplan.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
