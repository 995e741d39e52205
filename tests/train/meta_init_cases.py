"""Rank workers of the meta-device tests: dcplan.shard() of a model built on the meta device
makes one module at a time and keeps each rank's shard; the values equal a model built on one
rank from the same seed, and what cannot be made is refused before anything changes."""
from __future__ import annotations

import gc
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from train_harness import run_cases

SEED = 5
VOCAB, D, INNER = 41, 20, 33


class PositionBias(nn.Module):
    """A buffer and no parameters: reset_parameters() cannot make it; init= must."""

    def __init__(self, seq: int = 8):
        super().__init__()
        self.register_buffer("bias", torch.arange(seq, dtype=torch.float32)[:, None] / seq, persistent=False)

    def forward(self, h):
        return h + self.bias[: h.shape[1]]


class MetaNet(nn.Module):
    """torch's layers only (their reset_parameters draw what their constructors drew), and a
    head tied to the embedding last; with_buffer: a PositionBias too."""

    def __init__(self, with_buffer: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = PositionBias() if with_buffer else None
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, INNER)
        self.down = nn.Linear(INNER, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx)
        if self.pos is not None:
            h = self.pos(h)
        return self.head(h + self.down(F.gelu(self.up(self.norm(h)))))


def plain(with_buffer: bool = False) -> MetaNet:
    torch.manual_seed(SEED)
    return MetaNet(with_buffer)


def on_meta(with_buffer: bool = False) -> MetaNet:
    torch.manual_seed(SEED)
    with torch.device("meta"):
        return MetaNet(with_buffer)


def init_with_buffers(module: nn.Module) -> None:
    """A user's init: PositionBias's buffer, and torch's reset for the rest."""
    if isinstance(module, PositionBias):
        module.bias.copy_(torch.arange(module.bias.shape[0], dtype=torch.float32)[:, None] / module.bias.shape[0])
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def worker(rank: int, ws: int, store: str, out_dir: str) -> None:
    import dcplan

    def from_meta() -> Dict:
        """Default init; the largest full-size tensors held at once, seen from inside each init."""
        model = on_meta()
        held: List[int] = []

        def counting_init(module):
            # Every full-size parameter alive in the process, not only the model's: one that
            # shard() still referenced would count too.
            held.append(sum(o.numel() for o in gc.get_objects() if type(o) is nn.Parameter and not o.is_meta))
            module.reset_parameters()

        torch.manual_seed(SEED)
        dcplan.shard(model, init=counting_init)
        return {"params": dcplan.full_parameters(model), "held": held,
                "tied": model.head.weight is model.emb.weight, "out": model(tokens()).detach()}

    def default_init() -> Dict:
        model = on_meta()
        dcplan.shard(model)
        return {"params": dcplan.full_parameters(model)}

    def with_init() -> Dict:
        model = on_meta(with_buffer=True)
        dcplan.shard(model, init=init_with_buffers)
        return {"out": model(tokens()).detach()}

    def refusals() -> Dict:
        def error(fn, model) -> Dict:
            try:
                fn(model)
            except ValueError as e:
                return {"error": str(e), "still_meta": all(p.is_meta for p in model.parameters()),
                        "sharded": getattr(model, "_dcplan", None) is not None}
            return {"error": "no error"}

        mixed = on_meta()
        mixed.up = nn.Linear(D, INNER)
        rooted = on_meta()
        rooted.scale = nn.Parameter(torch.ones((), device="meta"))
        return {"buffer": error(dcplan.shard, on_meta(with_buffer=True)),
                "no_reset": error(dcplan.shard, rooted),
                "mixed": error(dcplan.shard, mixed),
                "init_on_made": error(lambda m: dcplan.shard(m, init=init_with_buffers), plain())}

    run_cases(rank, ws, store, out_dir, [("from_meta", from_meta, reference), ("default_init", default_init, None),
                                          ("with_init", with_init, reference_with_buffer), ("refusals", refusals, None)])


def reference() -> Dict:
    model = plain()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "out": model(tokens()).detach(),
            "largest_module": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())}


def reference_with_buffer() -> Dict:
    return {"out": plain(with_buffer=True)(tokens()).detach()}
