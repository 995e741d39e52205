"""Rank workers of the compiled-replay tests: dcplan.shard(..., compile=True) on 2 Gloo ranks
against single-process training of the same model under torch.compile, at every stage, with
gradient accumulation, tied weights, a module called twice and a frozen parameter."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model_cases import Block
from train_harness import run_cases

STEPS = 4
BATCH, SEQ, VOCAB, D = 4, 6, 23, 16
LR = 1e-3


class Net(nn.Module):
    """'base'; 'tied' (the head is the embedding's weight); 'twice' (a block called twice);
    'frozen' (the first block's parameters do not train); 'break' (a graph break between the
    blocks: Dynamo compiles the regions around it as separate graphs); 'ckpt' (each block under
    activation checkpointing, torch.utils.checkpoint with use_reentrant=False); 'bf16' and
    'bf16-eager' (the base model gathered in bf16, reduced in fp32: compiled and eager replay);
    'two' (the base model, two forwards before each backward: loss_of)."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if variant == "tied":
            self.head.weight = self.embed.weight
        if variant == "frozen":
            self.blocks[0].requires_grad_(False)

    def forward(self, idx):
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if self.variant == "ckpt":
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            if self.variant == "break" and i == 0:
                torch._dynamo.graph_break()
        if self.variant == "twice":
            x = self.blocks[1](x)
        return self.head(self.norm(x))


def make(variant: str, device: str) -> Net:
    torch.manual_seed(123)
    return Net(variant).to(device)


def data(accum: int, device: str):
    g = torch.Generator().manual_seed(9)
    return [[(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device),
              torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device))
             for _ in range(accum)] for _ in range(STEPS)]


def loss_of(model, idx, tgt, variant: str = ""):
    """'two': the batch in two halves, two forwards before one backward (their mean is the
    whole batch's mean loss)."""
    if variant == "two":
        half = idx.shape[0] // 2
        return (loss_of(model, idx[:half], tgt[:half]) + loss_of(model, idx[half:], tgt[half:])) / 2
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), tgt.reshape(-1))


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def reference(variant: str, accum: int, device: str) -> Dict:
    torch._dynamo.reset()
    model = make(variant, device)
    compiled = torch.compile(model)
    opt = _optimizer(model)
    losses = []
    for micro in data(accum, device):
        total = 0.0
        for idx, tgt in micro:
            loss = loss_of(compiled, idx, tgt, variant) / accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()}}


def sharded(variant: str, stage: int, accum: int, rank: int, ws: int, device: str) -> Dict:
    import dcplan

    torch._dynamo.reset()
    model = make(variant, device)
    compiled = variant != "bf16-eager"
    mixed = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if variant.startswith("bf16") else {}
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=1024, compile=compiled, **mixed)
    opt = _optimizer(model)
    per = BATCH // ws
    mine = slice(rank * per, (rank + 1) * per)
    losses, op_log, first_grads = [], None, None
    for s, micro in enumerate(data(accum, device)):
        if s == 1:
            dcplan._C.start_op_log()
        total = 0.0
        for m, (idx, tgt) in enumerate(micro):
            model.set_requires_gradient_sync(m == accum - 1)
            loss = loss_of(model, idx[mine], tgt[mine], variant) / accum
            loss.backward()
            total += loss.item()
        if s == 0:  # this rank's reduced shard gradients of the first step
            first_grads = {i.name: i.shard.grad.detach().cpu().clone() for i in model._dcplan.trainable_infos}
        opt.step()
        opt.zero_grad()
        if s == 1:
            op_log = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
        t = torch.tensor(total, device=device)
        dist.all_reduce(t)
        losses.append(t.item() / ws)
    state = model._dcplan
    params = {k: v.cpu() for k, v in dcplan.full_parameters(model).items()}
    return {"losses": losses, "params": params, "op_log": op_log, "first_grads": first_grads,
            "graphs": (state.fwd_graph, state.bwd_graph), "ids": {i.name: i.ds_id for i in state.infos}}


def worker(rank: int, ws: int, store: str, out_dir: str, cases: List[tuple], device: str = "cpu") -> None:
    """cases: (variant, stage, micro-steps per optimizer step); device "cuda": NCCL, rank r on GPU r."""
    run_cases(rank, ws, store, out_dir,
              [(f"{v}-zero{s}-accum{a}", lambda v=v, s=s, a=a: sharded(v, s, a, rank, ws, device),
                None if v.startswith("bf16") else lambda v=v, a=a: reference(v, a, device)) for v, s, a in cases],
              backend="nccl" if device == "cuda" else "gloo")
