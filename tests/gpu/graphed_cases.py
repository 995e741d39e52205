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
EVAL_AFTER = (3, 4)  # eval forwards (no grad) after these steps: between replays in the graphed run
MAX_NORM = 0.05  # small enough that every step clips


def warmup_cosine(step: int) -> float:
    """The learning rate's factor: 2 steps of linear warmup, then a cosine to 0 over STEPS."""
    import math

    return min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / (STEPS + 1)))


def clipped(model) -> torch.Tensor:
    """dcplan.clip_grad_norm_ with CUDA's sync debug mode at "error": torch's synchronising calls
    inside raise (.item(), a copy to the host); the runtime's own host waits are refused by the
    capture itself (begin_capture), so the graphed run checks those."""
    import dcplan

    torch.cuda.set_sync_debug_mode("error")
    try:
        return dcplan.clip_grad_norm_(model, MAX_NORM)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def train(variant: str, stage: int, accum: int, rank: int, ws: int, graphed: bool, clip: bool = False) -> Dict:
    import dcplan

    torch._dynamo.reset()
    replay, _, model_variant = variant.partition("-")  # "eager-frozen": eager hooks, cc's frozen model
    model = cc.make(model_variant or "base", "cuda")
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=1024, compile=replay == "compiled")
    # capturable: the step count lives on the GPU, so that a replay advances it. With clip, the
    # recipe of a real run: a tensor learning rate that a warmup-cosine schedule updates in place
    # between the replays (torch's schedulers fill a tensor lr), and clipping inside the step.
    # The recipe's optimizer is also the fused one (docs/compiled.md), as README's snippet has it.
    lr = torch.tensor(cc.LR, device="cuda") if clip else cc.LR
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, capturable=True, fused=clip or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine) if clip else None
    per = cc.BATCH // ws
    mine = slice(rank * per, (rank + 1) * per)

    def step(micro):
        total = torch.zeros((), device="cuda")
        for m, (idx, tgt) in enumerate(micro):
            model.set_requires_gradient_sync(m == accum - 1)
            loss = cc.loss_of(model, idx, tgt) / accum
            loss.backward()
            total += loss.detach()
        norm = clipped(model) if clip else torch.zeros((), device="cuda")
        opt.step()
        opt.zero_grad()
        return torch.stack([total, norm])

    run = dcplan.graphed_step(step, warmup=2) if graphed else step
    losses: List[float] = []
    evals: List[float] = []
    host_ops = None
    data = cc.data(accum, "cuda")
    for s in range(STEPS):
        micro = [(idx[mine], tgt[mine]) for idx, tgt in data[s % len(data)]]  # cc.data has cc.STEPS batches
        if graphed and s == LOGGED:
            dcplan._C.start_op_log()
        losses.append(run(micro).tolist())  # the loss and the clipped norm
        if sched is not None:
            sched.step()
        if graphed and s == LOGGED:
            host_ops = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
        if s in EVAL_AFTER:  # beside the training graph: it runs eagerly and keeps the graph
            model.eval()
            with torch.no_grad():
                idx, tgt = data[0][0]
                evals.append(cc.loss_of(model, idx[mine], tgt[mine]).item())
            model.train()
    refused = None
    if graphed:
        try:
            model(data[0][0][0][mine])
        except RuntimeError as e:
            refused = str(e)
        assert model._dcplan.forward_depth == 0  # the refused forward left no forward open
        run.close()
    refused_check = None
    if graphed and clip:
        # error_if_nonfinite reads the norm on the host: refused inside a capture, before any work.
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                dcplan.clip_grad_norm_(model, MAX_NORM, error_if_nonfinite=True)
        except RuntimeError as e:
            refused_check = str(e)
    # One eager step after the graph (after close() in the graphed run).
    losses.append(step([(idx[mine], tgt[mine]) for idx, tgt in data[0]]).tolist())
    params = {k: v.cpu() for k, v in dcplan.full_parameters(model).items()}
    return {"losses": losses, "evals": evals, "params": params, "host_ops": host_ops, "refused": refused,
            "refused_check": refused_check,
            "captured": graphed and run is not step}


def both(variant: str, stage: int, accum: int, rank: int, ws: int, clip: bool = False) -> Dict:
    """The graphed run, then the plain one on a fresh runtime (both on every rank)."""
    import dcplan

    graphed = train(variant, stage, accum, rank, ws, True, clip)
    dcplan.shutdown()
    return {"graphed": graphed, "plain": train(variant, stage, accum, rank, ws, False, clip)}


def case_name(variant: str, stage: int, accum: int, clip: bool = False) -> str:
    return f"{variant}-zero{stage}-accum{accum}" + ("-clip" if clip else "")


def worker(rank: int, ws: int, store: str, out_dir: str, cases: List[tuple], device: str = "cuda") -> None:
    """cases: (variant "eager" | "compiled", stage, micro-steps, clip); NCCL, rank r on GPU r."""
    run_cases(rank, ws, store, out_dir,
              [(case_name(*c), lambda c=c: both(c[0], c[1], c[2], rank, ws, c[3]), None) for c in cases],
              backend="nccl")
