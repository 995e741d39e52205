"""dcplan in torchtitan: a ``parallelize_fn`` for torchtitan's Llama 3 that calls ``dcplan.shard``
where torchtitan's ``parallelize_llama`` calls ``apply_fsdp_to_decoder`` (torchtitan 0.3).

With torchtitan installed, use its llama3 model spec with this function::

    import torchtitan_dcplan
    config.model_spec = torchtitan_dcplan.dcplan_model_spec("8B")   # in a config_registry function

Without torchtitan, run this file: it builds a small Llama-style model (train_llama.py's) on
the meta device as torchtitan does, passes it through the same function with torchtitan-shaped
settings, and prints the losses next to the unsharded model's::

    torchrun --nproc-per-node 2 examples/torchtitan_dcplan.py

What differs from FSDP2 in torchtitan (docs/migrating.md#from-torchtitan-parallelize_fn):
torchtitan builds the model on the meta device and initialises it after ``parallelize_fn``;
dcplan needs the weights before it shards, so ``parallelize_llama`` materialises and
initialises the model first (every rank from torchtitan's seed) and makes the trainer's later
``to_empty`` and ``init_weights`` calls no-ops on the sharded model.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

import dcplan

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parallelize_llama(model: nn.Module, *, parallel_dims, training, parallelism=None, compile_config=None,
                      ac_config=None, dump_folder: str = ".") -> nn.Module:
    """torchtitan 0.3's parallelize_fn signature. Keeps torchtitan's activation checkpointing;
    dcplan replaces per-block compile (``compile_config.enable``: the whole forward) and FSDP
    (``training.mixed_precision_param`` / ``mixed_precision_reduce``: dcplan's dtypes)."""
    others = [name for name in ("tp", "cp", "pp", "ep", "dp_replicate") if getattr(parallel_dims, f"{name}_enabled")]
    if others:
        raise NotImplementedError(f"torchtitan_dcplan: dcplan shards one data-parallel group; this job also enables "
                                  f"{', '.join(others)} (set those degrees to 1)")
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    _materialize(model)
    compile_model = compile_config is not None and compile_config.enable and "model" in compile_config.components
    dcplan.shard(model, stage=3, param_dtype=_DTYPES[training.mixed_precision_param],
                 reduce_dtype=_DTYPES[training.mixed_precision_reduce], compile=compile_model)
    # torchtitan calls these after parallelize_fn; the sharded weights are already initialised,
    # and new storage would detach them from the runtime.
    model.to_empty = lambda *args, **kwargs: model
    model.init_weights = lambda *args, **kwargs: None
    return model


def _materialize(model: nn.Module) -> None:
    """A meta-device model's weights, made on this rank's device and initialised as torchtitan
    would after parallelize_fn (its seed is set on every rank alike before the model is built)."""
    if not any(p.is_meta for p in model.parameters()):
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)


def dcplan_model_spec(flavor: str, **model_registry_args):
    """torchtitan's llama3 model spec of flavor, with this parallelize_fn (pipelining off)."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(flavor, **model_registry_args)
    return dataclasses.replace(spec, name="llama3_dcplan", parallelize_fn=parallelize_llama, pipelining_fn=None)


# -- without torchtitan: the same function on a small Llama-style model --------------------------

def torchtitan_settings(world_size: int):
    """The settings parallelize_llama reads, as torchtitan's config would give them (data
    parallel only, fp32 here: the CPU ranks compare with the unsharded model number for number)."""
    dims = SimpleNamespace(world_size=world_size, tp_enabled=False, cp_enabled=False, pp_enabled=False,
                           ep_enabled=False, dp_replicate_enabled=False)
    training = SimpleNamespace(mixed_precision_param="float32", mixed_precision_reduce="float32")
    return {"parallel_dims": dims, "training": training,
            "compile_config": SimpleNamespace(enable=False, components=["model", "loss"])}


def titan_style_llama():
    """train_llama.py's model with torchtitan's init protocol (BaseModel.init_weights): built on
    the meta device, then to_empty and init_weights(buffer_device=...)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_llama import Llama, RotaryEmbedding

    class TitanStyleLlama(Llama):
        def init_weights(self, buffer_device=None):
            for m in self.modules():
                if isinstance(m, RotaryEmbedding):  # buffers: to_empty left them uninitialised
                    fresh = RotaryEmbedding(2 * m.cos.shape[1], m.cos.shape[0])
                    m.cos.copy_(fresh.cos)
                    m.sin.copy_(fresh.sin)
                elif m is not self and hasattr(m, "reset_parameters"):
                    m.reset_parameters()

    with torch.device("meta"):
        return TitanStyleLlama(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=192, max_seq=32, tied=False)


def main(steps: int = 4) -> None:
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # torchtitan seeds every rank alike before it builds the model
    model = parallelize_llama(titan_style_llama(), **torchtitan_settings(ws))
    model.to_empty(device="cpu")  # what torchtitan's trainer does next: no-ops on the sharded model
    model.init_weights(buffer_device=torch.device("cpu"))
    reference = titan_style_llama()  # unsharded, initialised from the same seed
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        reference.init_weights()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(steps):
        tokens = torch.randint(0, 256, (2 * ws, 33), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt, batch in ((model, opts[0], tokens[rank * 2:(rank + 1) * 2]), (reference, opts[1], tokens)):
            loss = nn.functional.cross_entropy(m(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        dist.all_reduce(losses[0])
        if rank == 0:
            print(f"step {step}: loss {losses[0].item() / ws:.7f} unsharded {losses[1].item():.7f}", flush=True)
    dcplan.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
