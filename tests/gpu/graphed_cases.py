"""Rank workers of the CUDA graph tests: a sharded model trained by dcplan.graphed_step (two
warm-up calls, one capture, replays) against the same model trained by the same step function
called plainly, in one process; then, after close(), the model runs eagerly again."""
from __future__ import annotations

import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train"))
import compiled_cases as cc  # noqa: E402
from train_harness import run_cases  # noqa: E402

STEPS = 6     # 2 warm-up calls, the capture (whose call replays once), 3 more replays
LOGGED = 4    # the step whose host ops are logged: a replay


def train(variant: str, stage: int, accum: int, rank: int, ws: int, graphed: bool) -> Dict:
    import dcplan

    torch._dynamo.reset()
    model = cc.make("base", "cuda")
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=1024, compile=variant == "compiled")
    # capturable: the step count lives on the GPU, so that a replay advances it.
    opt = torch.optim.AdamW(model.parameters(), lr=cc.LR, weight_decay=0.01, capturable=True)
    per = cc.BATCH // ws
    mine = slice(rank * per, (rank + 1) * per)

    def step(micro):
        total = torch.zeros((), device="cuda")
        for m, (idx, tgt) in enumerate(micro):
            model.set_requires_gradient_sync(m == accum - 1)
            loss = cc.loss_of(model, idx, tgt) / accum
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    run = dcplan.graphed_step(step, warmup=2) if graphed else step
    losses: List[float] = []
    host_ops = None
    data = cc.data(accum, "cuda")
    for s in range(STEPS):
        micro = [(idx[mine], tgt[mine]) for idx, tgt in data[s % len(data)]]  # cc.data has cc.STEPS batches
        if graphed and s == LOGGED:
            dcplan._C.start_op_log()
        losses.append(run(micro).item())
        if graphed and s == LOGGED:
            host_ops = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
    refused = None
    if graphed:
        try:
            model(data[0][0][0][mine])
        except RuntimeError as e:
            refused = str(e)
        assert model._dcplan.forward_depth == 0  # the refused forward left no forward open
        run.close()
    # One eager step after the graph (after close() in the graphed run).
    losses.append(step([(idx[mine], tgt[mine]) for idx, tgt in data[0]]).item())
    params = {k: v.cpu() for k, v in dcplan.full_parameters(model).items()}
    return {"losses": losses, "params": params, "host_ops": host_ops, "refused": refused,
            "captured": graphed and run is not step}


def both(variant: str, stage: int, accum: int, rank: int, ws: int) -> Dict:
    """The graphed run, then the plain one on a fresh runtime (both on every rank)."""
    import dcplan

    graphed = train(variant, stage, accum, rank, ws, True)
    dcplan.shutdown()
    return {"graphed": graphed, "plain": train(variant, stage, accum, rank, ws, False)}


def worker(rank: int, ws: int, store: str, out_dir: str, cases: List[tuple], device: str = "cuda") -> None:
    """cases: (variant "eager" | "compiled", stage, micro-steps); NCCL, rank r on GPU r."""
    run_cases(rank, ws, store, out_dir,
              [(f"{v}-zero{s}-accum{a}", lambda v=v, s=s, a=a: both(v, s, a, rank, ws), None) for v, s, a in cases],
              backend="nccl")
