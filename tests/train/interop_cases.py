"""Rank workers of the interoperability tests: dcplan's DCP checkpoints hold the original shapes,
so FSDP2 (torch.distributed.checkpoint.state_dict) loads them, dcplan loads FSDP2's, and a
checkpoint of another model is refused by name. The model is one no other test uses; its
embedding has 41 rows, which neither 2 nor 3 ranks divide (the all-to-all path), and its
down-projection 20 (the view path on 2 ranks)."""
from __future__ import annotations

import os
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from train_harness import run_cases, step

VOCAB, D, INNER = 41, 20, 33
BATCH, SEQ = 6, 5
LR = 1e-2
HALF = 3


class Net(nn.Module):
    """An embedding, a norm, an MLP (down.weight is (20, 33)) and an untied head; rows=VOCAB+2
    gives a model of other shapes (a checkpoint of another model)."""

    def __init__(self, rows: int = VOCAB):
        super().__init__()
        self.emb = nn.Embedding(rows, D)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, INNER)
        self.down = nn.Linear(INNER, D, bias=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + self.down(F.gelu(self.up(self.norm(h)))))


def make_net(seed: int, rows: int = VOCAB) -> Net:
    torch.manual_seed(seed)
    return Net(rows)


def train(model, opt, steps: range, rank: int, ws: int) -> List[float]:
    """Each step on this rank's part of a global batch of BATCH sequences."""
    per = BATCH // ws
    losses = []
    for s in steps:
        g = torch.Generator().manual_seed(100 + s)
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)[rank * per:(rank + 1) * per]
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        if dist.is_initialized():
            losses.append(step(loss, opt, ws))
        else:  # the one-process reference
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


# -- the two ways a model is sharded, and their state dicts ---------------------------------------

def dcplan_net(stage: int, seed: int, rows: int = VOCAB):
    import dcplan

    model = make_net(seed, rows)
    dcplan.shard(model, stage=stage)
    return model, adamw(model)


def fsdp_net(seed: int, ws: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed)
    mesh = init_device_mesh("cpu", (ws,))
    for module in (model.emb, model.up, model.down, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, adamw(model)


def dcplan_state(model, opt, **options) -> Dict:
    import dcplan

    opts = dcplan.StateDictOptions(**options)
    return {"model": dcplan.get_model_state_dict(model, options=opts),
            "optim": dcplan.get_optimizer_state_dict(model, opt, options=opts)}


def fsdp_state(model, opt, **options) -> Dict:
    from torch.distributed.checkpoint import state_dict as dsd

    opts = dsd.StateDictOptions(**options)
    return {"model": dsd.get_model_state_dict(model, options=opts),
            "optim": dsd.get_optimizer_state_dict(model, opt, options=opts)}


def dcplan_load(model, opt, path: str, **options) -> None:
    import dcplan

    sd = dcplan_state(model, opt, **options)
    dcp.load(sd, checkpoint_id=path)
    opts = dcplan.StateDictOptions(**options)
    dcplan.set_model_state_dict(model, sd["model"], options=opts)
    dcplan.set_optimizer_state_dict(model, opt, sd["optim"], options=opts)


def fsdp_load(model, opt, path: str) -> None:
    from torch.distributed.checkpoint import state_dict as dsd

    sd = fsdp_state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    dsd.set_model_state_dict(model, sd["model"])
    dsd.set_optimizer_state_dict(model, opt, sd["optim"])


def full(state: Dict) -> Dict:
    """The parts of a full state dict both libraries give alike: model tensors, per-parameter
    optimizer state, and each group's parameter names and lr."""
    groups = [{"params": list(g["params"]), "lr": float(g["lr"])} for g in state["optim"]["param_groups"]]
    return {"model": state["model"], "state": state["optim"]["state"], "groups": groups}


# -- parameters grouped by their shape ------------------------------------------------------------

def groups_by_shape(model) -> Dict[str, List[str]]:
    """The names each common recipe puts in its decay group (nanoGPT's p.dim() >= 2, p.ndim >= 2,
    len(p.shape) > 1, transformers' Trainer where installed), and the shapes and count."""
    named = list(model.named_parameters())
    out = {"nanogpt": [n for n, p in named if p.dim() >= 2], "ndim": [n for n, p in named if p.ndim >= 2],
           "shape": [n for n, p in named if len(p.shape) > 1],
           "shapes": [(n, tuple(p.shape), tuple(p.size())) for n, p in named],
           "count": sum(p.numel() for _, p in named)}
    try:
        from transformers import Trainer
    except ImportError:
        return out
    out["transformers"] = sorted(Trainer.get_decay_parameter_names(None, model))  # reads no Trainer state
    return out


def nanogpt_adamw(model) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: weight decay for the parameters of 2 and more dimensions."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)


def grouped_reference() -> Dict:
    """nanoGPT's groups on the unsharded model, trained in one process on the global batch."""
    model = make_net(1234)
    groups = groups_by_shape(model)
    opt = nanogpt_adamw(model)
    losses = train(model, opt, range(HALF), 0, 1)
    return {"groups": groups, "losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- the worker ---------------------------------------------------------------------------------

def worker(rank: int, ws: int, store: str, out_dir: str, ckpt_dir: str) -> None:
    """dcplan saves, FSDP2 loads; FSDP2 saves, dcplan loads (at another stage); a flat_shards
    checkpoint (dcplan's old layout) loads and saves again; bad checkpoints are refused."""
    path = {name: os.path.join(ckpt_dir, name) for name in ("dcplan", "fsdp", "flat", "resaved")}

    def dcplan_save() -> Dict:
        model, opt = dcplan_net(3, 1234)
        losses = train(model, opt, range(HALF), rank, ws)
        dcp.save(dcplan_state(model, opt), checkpoint_id=path["dcplan"])
        return {"losses": losses, "full": full(dcplan_state(model, opt, full_state_dict=True))}

    def to_fsdp() -> Dict:
        model, opt = fsdp_net(7, ws)
        before = full(fsdp_state(model, opt, full_state_dict=True))
        fsdp_load(model, opt, path["dcplan"])
        return {"before": before, "full": full(fsdp_state(model, opt, full_state_dict=True))}

    def fsdp_save() -> Dict:
        model, opt = fsdp_net(1234, ws)
        train(model, opt, range(HALF), rank, ws)
        dcp.save(fsdp_state(model, opt), checkpoint_id=path["fsdp"])
        return {"full": full(fsdp_state(model, opt, full_state_dict=True))}

    def from_fsdp() -> Dict:
        model, opt = dcplan_net(2, 7)
        dcplan_load(model, opt, path["fsdp"])
        return {"full": full(dcplan_state(model, opt, full_state_dict=True))}

    def flat() -> Dict:
        model, opt = dcplan_net(3, 1234)
        train(model, opt, range(HALF), rank, ws)
        dcp.save(dcplan_state(model, opt, flat_shards=True), checkpoint_id=path["flat"])
        saved = full(dcplan_state(model, opt, full_state_dict=True))
        model, opt = dcplan_net(1, 7)
        dcplan_load(model, opt, path["flat"], flat_shards=True)
        dcp.save(dcplan_state(model, opt), checkpoint_id=path["resaved"])
        return {"saved": saved, "loaded": full(dcplan_state(model, opt, full_state_dict=True)),
                "flat_as_new": refusal(lambda: dcplan_load(*dcplan_net(3, 7), path["flat"]))}

    def grouped() -> Dict:
        import dcplan

        model = make_net(1234)
        dcplan.shard(model, stage=3)
        groups = groups_by_shape(model)
        losses = train(model, nanogpt_adamw(model), range(HALF), rank, ws)
        model.to("cpu")  # where the shards are: nothing to do
        return {"groups": groups, "losses": losses, "params": dcplan.full_parameters(model),
                "cast": refusal(lambda: model.to(torch.float64))}

    def refusals() -> Dict:
        def other_shape():
            dcplan_load(*dcplan_net(3, 7, rows=VOCAB + 2), path["dcplan"])

        def missing_key():
            model, opt = dcplan_net(3, 7)
            sd = dcplan_state(model, opt)
            sd["model"]["extra.weight"] = sd["model"]["down.weight"]
            dcp.load(sd, checkpoint_id=path["dcplan"])

        def dtensor(placement: str):
            """A DTensor of the right shape but another placement, or with a part of the wrong
            size, for head.weight: refused before emb.weight (loaded first) is written."""
            import dcplan
            from torch.distributed.tensor import DTensor, Replicate, Shard

            model, opt = dcplan_net(3, 7)
            sd = dcplan_state(model, opt)["model"]
            mesh = sd["emb.weight"].device_mesh
            sd["emb.weight"] = DTensor.from_local(torch.ones_like(sd["emb.weight"].to_local()), mesh, [Shard(0)],
                                                  run_check=False, shape=(VOCAB, D), stride=(D, 1))
            if placement == "replicate":
                sd["head.weight"] = DTensor.from_local(torch.zeros(VOCAB, D), mesh, [Replicate()], run_check=False)
            else:
                sd["head.weight"] = DTensor.from_local(torch.zeros(1, D), mesh, [Shard(0)], run_check=False,
                                                       shape=(VOCAB, D), stride=(D, 1))
            before = dcplan.full_parameters(model)["emb.weight"]
            error = refusal(lambda: dcplan.set_model_state_dict(model, sd))
            return {"error": error, "unchanged": torch.equal(dcplan.full_parameters(model)["emb.weight"], before)}

        return {"other_shape": refusal(other_shape), "missing_key": refusal(missing_key),
                "replicated": dtensor("replicate"), "wrong_part": dtensor("part")}

    run_cases(rank, ws, store, out_dir, [(name, fn, None) for name, fn in [
        ("dcplan_save", dcplan_save), ("to_fsdp", to_fsdp), ("fsdp_save", fsdp_save), ("from_fsdp", from_fsdp),
        ("flat", flat), ("refusals", refusals)]] + [("grouped", grouped, grouped_reference)])


def refusal(fn) -> str:
    """The error fn raises (its text), or 'no error'. A DCP load that fails raises on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP gathers the ranks' errors on every rank
        return f"{type(e).__name__}: {e}"
    return "no error"
