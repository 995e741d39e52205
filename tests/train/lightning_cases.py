"""Rank workers of the Lightning test: a LightningModule trained by Trainer(strategy="dcplan") on
2 CPU processes, with gradient clipping (norm) and accumulation, straight and through a
checkpoint; and the same training in plain PyTorch in one process."""
from __future__ import annotations

import os
import traceback
from typing import Dict, List

import torch
import torch.nn.functional as F

import interop_cases as ic

EPOCH_BATCHES = 4  # micro-batches per epoch
ACCUMULATE = 2  # micro-batches per optimizer step
CLIP = 0.05  # below every step's gradient norm (the reference checks it), so every step clips
EPOCHS = 2


def global_batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, ic.VOCAB, (ic.BATCH, ic.SEQ + 1), generator=g)


def lit_module(seed: int):
    import lightning.pytorch as pl

    class LitNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ic.make_net(seed)
            self.losses: List[float] = []

        def forward(self, idx):
            return self.net(idx)

        def training_step(self, batch, batch_idx):
            logits = self(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=ic.LR, weight_decay=0.01)

    return LitNet()


def fit(seed: int, epochs: int, rank: int, ws: int, ckpt_path=None, save_to=None) -> Dict:
    """Trainer(strategy="dcplan") over this rank's rows of each global batch."""
    import lightning.pytorch as pl

    import dcplan

    per = ic.BATCH // ws
    data = [global_batch(i)[rank * per:(rank + 1) * per] for i in range(EPOCH_BATCHES)]
    module = lit_module(seed)
    trainer = pl.Trainer(accelerator="cpu", devices=ws, strategy="dcplan", max_epochs=epochs,
                         accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None)  # each item a batch
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"losses": module.losses, "params": dcplan.full_parameters(module)}


def worker(rank: int, ws: int, store: str, out_dir: str, port: int, ckpt: str) -> None:
    """Straight: EPOCHS epochs. Then one epoch and a checkpoint; a new module (other values)
    resumes from it for the rest."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ws),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    results: Dict = {}
    try:
        straight = fit(1234, EPOCHS, rank, ws)
        first = fit(1234, 1, rank, ws, save_to=ckpt)
        resumed = fit(7, EPOCHS, rank, ws, ckpt_path=ckpt)
        results["lightning"] = {"value": {"straight": straight, "first": first, "resumed": resumed}}
    except Exception:
        results["lightning"] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def reference() -> Dict:
    """The same training in plain PyTorch, one process, the global batches: Lightning divides
    each micro-batch's loss by the accumulation, and clips the total norm before each step."""
    model = ic.make_net(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=ic.LR, weight_decay=0.01)
    losses, norms = [], []
    for _ in range(EPOCHS):
        for i in range(EPOCH_BATCHES):
            batch = global_batch(i)
            loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            losses.append(loss.item())
            (loss / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
                opt.step()
                opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
