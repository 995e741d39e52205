"""Rank workers of the model tests: parameters read outside their module, and activation
checkpointing (torch.utils.checkpoint, use_reentrant False and True), sharded against one process."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from train_harness import run_cases

STEPS = 5
BATCH, SEQ, VOCAB, D = 6, 5, 29, 12
LR = 1e-3


class Block(nn.Module):
    """A pre-norm MLP block of width d (an odd inner width: shards are padded)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d + 3)
        self.down = nn.Linear(2 * d + 3, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Reader(nn.Module):
    """Reads the embedding's weight, a parameter of another module (output projection), and the
    first block's up-projection bias, in its own forward."""

    def __init__(self, embed: nn.Embedding, other: nn.Linear):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))
        self.refs = [embed, other]  # a list: not submodules, so the parameters stay theirs

    def forward(self, h):
        embed, other = self.refs
        h = h * self.scale + other.bias[:D]
        return h @ embed.weight.t() + embed.weight[0, 0]  # read twice: gathered once


class Net(nn.Module):
    """variant: 'reader' (parameters read outside their module, by a module and by the root),
    'ckpt' (each block under activation checkpointing), 'ckpt-reader' (both, the reader
    checkpointed too: it reads again in backward), 'reentrant-ckpt' (use_reentrant=True)."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.reader = Reader(self.embed, self.blocks[0].up) if "reader" in variant else None
        self.head = nn.Linear(D, VOCAB, bias=False) if self.reader is None else None

    def forward(self, idx):
        x = self.embed(idx)
        if "reader" in self.variant:
            x = x + 0.1 * self.blocks[2].norm.weight  # the root reads a block's parameter
        for block in self.blocks:
            if "ckpt" in self.variant and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=self.variant.startswith("reentrant"))
            else:
                x = block(x)
        h = self.norm(x)
        if self.reader is None:
            return self.head(h)
        if "ckpt" in self.variant and torch.is_grad_enabled():  # its reads happen again in backward
            return checkpoint(self.reader, h, use_reentrant=self.variant.startswith("reentrant"))
        return self.reader(h)


def make(variant: str) -> Net:
    torch.manual_seed(321)
    return Net(variant)


def data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def loss_of(model, idx, tgt):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


def reference(variant: str) -> Dict:
    model = make(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for idx, tgt in data():
        loss = loss_of(model, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def sharded(variant: str, stage: int, rank: int, ws: int) -> Dict:
    import dcplan

    model = make(variant)
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=512)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    per = BATCH // ws
    losses = []
    for s, (idx, tgt) in enumerate(data()):
        if s == 2:
            dcplan._C.start_op_log()
        mine = slice(rank * per, (rank + 1) * per)
        loss = loss_of(model, idx[mine], tgt[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if s == 2:
            op_log = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
        with torch.no_grad():  # an eval forward between steps
            model(idx[mine])
    state = model._dcplan
    return {"losses": losses, "params": dcplan.full_parameters(model), "op_log": op_log,
            "graphs": (state.fwd_graph, state.bwd_graph), "ids": {i.name: i.ds_id for i in state.infos}}


def worker(rank: int, ws: int, store: str, out_dir: str, cases: List[tuple]) -> None:
    run_cases(rank, ws, store, out_dir,
              [(f"{v}-zero{s}", lambda v=v, s=s: sharded(v, s, rank, ws), lambda v=v: reference(v)) for v, s in cases])
