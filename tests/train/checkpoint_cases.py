"""Rank workers of the checkpoint tests: full and sharded (torch.distributed.checkpoint) state
dicts of dcplan-sharded models and their optimizers, exact resume, and resharding."""
from __future__ import annotations

import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import dist_cases  # noqa: E402  (the tiny transformer, its data and loss)
from dist_cases import Case, batches, loss_fn  # noqa: E402
from train_harness import init_group, run_cases, step  # noqa: E402

LR = dist_cases.LR
STEPS = 6
HALF = 3


class CkptModel(dist_cases.TinyTransformer):
    """The tiny transformer with tied embeddings, a 0-dim parameter (a logit scale) and an int64
    buffer (forwards seen): what a checkpoint must carry besides plain weights."""

    def __init__(self):
        super().__init__(tied=True)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.int64))

    def forward(self, idx):
        if self.training and torch.is_grad_enabled():
            self.seen += 1
        return super().forward(idx) * self.logit_scale


def make_ckpt_model(seed: int = 1234) -> CkptModel:
    """seed other than 1234: other values, so that only a load makes it equal to a trained one."""
    torch.manual_seed(1234)
    model = CkptModel()
    if seed != 1234:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
            model.seen.fill_(seed)
    return model


def sharded(stage: int, seed: int = 1234):
    """A fresh sharded CkptModel and its AdamW."""
    import dcplan

    model = make_ckpt_model(seed)
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=dist_cases.BUCKET_BYTES)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return model, opt


def train(model, opt, steps: range, rank: int, ws: int) -> List[float]:
    per = dist_cases.BATCH // ws
    data = batches(Case("ckpt", 3), model.embed.num_embeddings)
    losses = []
    for s in steps:
        idx, tgt = data[s][0]
        mine = slice(rank * per, (rank + 1) * per)
        loss = loss_fn(model, idx[mine], tgt[mine])
        losses.append(step(loss, opt, ws))
    return losses


def full_state(model, opt) -> Dict:
    import dcplan

    opts = dcplan.StateDictOptions(full_state_dict=True)
    return {"model": dcplan.get_model_state_dict(model, options=opts),
            "optim": dcplan.get_optimizer_state_dict(model, opt, options=opts)}


def sharded_state(model, opt) -> Dict:
    import dcplan

    return {"model": dcplan.get_model_state_dict(model), "optim": dcplan.get_optimizer_state_dict(model, opt)}


def load_sharded(model, opt, path: str) -> None:
    import dcplan

    sd = sharded_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    dcplan.set_model_state_dict(model, sd["model"])
    dcplan.set_optimizer_state_dict(model, opt, sd["optim"])


def resume_worker(rank: int, ws: int, store: str, out_dir: str, stages: List[int]) -> None:
    """Per stage: 6 steps straight; then 3 steps, a DCP save, a new process group and a new
    model loaded from it, 3 steps. Also the full state dict's round trips."""
    run_cases(rank, ws, store, out_dir,
              [(f"zero{stage}", lambda stage=stage: resume(stage, rank, ws, store, out_dir), None) for stage in stages])


def resume(stage: int, rank: int, ws: int, store: str, out_dir: str) -> Dict:
    import dcplan

    model, opt = sharded(stage)
    straight = train(model, opt, range(STEPS), rank, ws)
    straight_full = full_state(model, opt)
    dcplan.shutdown()
    del model, opt

    model, opt = sharded(stage)
    first = train(model, opt, range(HALF), rank, ws)
    path = os.path.join(out_dir, f"ckpt-{stage}")
    dcp.save(sharded_state(model, opt), checkpoint_id=path)
    saved_full = full_state(model, opt)
    offloaded = dcplan.get_model_state_dict(
        model, options=dcplan.StateDictOptions(full_state_dict=True, cpu_offload=True))
    dcplan.shutdown()
    del model, opt
    dist.destroy_process_group()

    init_group(rank, ws, f"{store}.{stage}.new")  # a new process group
    model, opt = sharded(stage, seed=7)
    before_load = full_state(model, opt)
    load_sharded(model, opt, path)
    loaded_full = full_state(model, opt)
    second = train(model, opt, range(HALF, STEPS), rank, ws)
    resumed_full = full_state(model, opt)

    # Full state dict back into a sharded model: every rank passing it, and rank 0 only.
    dcplan.shutdown()
    model2, opt2 = sharded(stage, seed=8)
    dcplan.set_model_state_dict(model2, saved_full["model"])
    dcplan.set_optimizer_state_dict(model2, opt2, saved_full["optim"])
    from_full = full_state(model2, opt2)
    dcplan.shutdown()
    model3, opt3 = sharded(stage, seed=9)
    opts = dcplan.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcplan.set_model_state_dict(model3, saved_full["model"] if rank == 0 else {}, options=opts)
    dcplan.set_optimizer_state_dict(model3, opt3, saved_full["optim"] if rank == 0 else {}, options=opts)
    from_rank0 = full_state(model3, opt3)
    errors = load_errors(model3, opt3, saved_full, rank)
    return {"straight": straight, "first": first, "second": second, "straight_full": straight_full,
            "saved_full": saved_full, "before_load": before_load, "loaded_full": loaded_full,
            "resumed_full": resumed_full, "offloaded": offloaded, "from_full": from_full,
            "from_rank0": from_rank0, "errors": errors}


def load_errors(model, opt, full: Dict, rank: int) -> Dict[str, str]:
    """What bad state dicts raise, on every rank alike (broadcast: rank 0's check reaches all)."""
    import dcplan

    def error(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return "no error"

    bad_shape = dict(full["model"], **{"block.attn.proj.weight": torch.zeros(3, 3)})
    missing = {k: v for k, v in full["model"].items() if k != "ln_f.bias"}
    extra = dict(full["model"], bogus=torch.zeros(1))
    opts = dcplan.StateDictOptions(full_state_dict=True)
    bcast = dcplan.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    lenient = dcplan.StateDictOptions(full_state_dict=True, strict=False)
    return {
        "missing": error(lambda: dcplan.set_model_state_dict(model, missing, options=opts)),
        "unexpected": error(lambda: dcplan.set_model_state_dict(model, extra, options=opts)),
        "lenient": str(dcplan.set_model_state_dict(model, extra, options=lenient)),
        "shape": error(lambda: dcplan.set_model_state_dict(model, bad_shape, options=opts)),
        "shape_broadcast": error(lambda: dcplan.set_model_state_dict(model, bad_shape if rank == 0 else {},
                                                                     options=bcast)),
        "optim_broadcast": error(lambda: dcplan.set_optimizer_state_dict(
            model, opt, {"state": {}, "param_groups": []} if rank == 0 else None, options=bcast)),
        "offload_sharded": error(lambda: dcplan.get_model_state_dict(
            model, options=dcplan.StateDictOptions(cpu_offload=True))),
    }


def reshard_save_worker(rank: int, ws: int, store: str, out_dir: str, stage: int, path: str) -> None:
    """Trains 3 steps on ws ranks and saves a DCP checkpoint (and its full form, to compare)."""

    def save() -> Dict:
        model, opt = sharded(stage)
        losses = train(model, opt, range(HALF), rank, ws)
        dcp.save(sharded_state(model, opt), checkpoint_id=path)
        return {"losses": losses, "full": full_state(model, opt)}

    run_cases(rank, ws, store, out_dir, [("save", save, None)])


def reshard_load_worker(rank: int, ws: int, store: str, out_dir: str, stage: int, path: str) -> None:
    """Loads that checkpoint on ws (other) ranks at stage (maybe another), then trains the last 3 steps."""
    import dcplan

    def load() -> Dict:
        model, opt = sharded(stage, seed=7)
        load_sharded(model, opt, path)
        loaded = full_state(model, opt)
        losses = train(model, opt, range(HALF, STEPS), rank, ws)
        return {"loaded": loaded, "losses": losses, "params": dcplan.full_parameters(model)}

    run_cases(rank, ws, store, out_dir, [("load", load, reference)])


def reference() -> Dict:
    """The same 6 steps in one process on the global batch."""
    model = make_ckpt_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for micro_batches in batches(Case("ckpt", 3), model.embed.num_embeddings)[:STEPS]:
        idx, tgt = micro_batches[0]
        loss = loss_fn(model, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}
