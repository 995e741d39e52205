#!/usr/bin/env python3
"""Trains a small Llama-style model with dcplan's ZeRO sharding.

    torchrun --standalone --nproc-per-node 2 examples/train_llama.py  # 2 CPU ranks (Gloo)
    torchrun --nproc-per-node 2 examples/train_llama.py --device cuda  # 2 GPUs (NCCL)
    python examples/train_llama.py --no-shard --ranks 2                # plain single-process reference

The model: token embedding, per block RMSNorm + grouped-query attention with rotary
embeddings + RMSNorm + SwiGLU MLP, a final RMSNorm and an output head (tied to the
embedding with --tied; --fused: one projection for q, k and v and one for gate and up, which
initialise and train to the same numbers). Its size comes from the flags. The data are synthetic and
deterministic: every step draws one global batch of sequences made of repeated short
random patterns (learnable, so the loss falls) and each rank trains on its slice, so a
sharded run and a --no-shard run of the same global batch give the same losses.
Rank 0 prints one line per step; --losses FILE writes them as JSON.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
        # Buffers, not parameters: nothing to shard.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: batch, heads, seq, head_dim
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, rotary: RotaryEmbedding, fused: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        widths = (heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim)
        if fused:  # one projection for q, k and v, split after the matmul
            self.wqkv = nn.Linear(hidden, sum(widths), bias=False)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(hidden, w, bias=False) for w in widths)
        self.widths = widths
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, fused: bool = False):
        super().__init__()
        if fused:  # one projection for gate and up
            self.w_gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        else:
            self.w_gate = nn.Linear(hidden, ffn, bias=False)
            self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w_gate_up"):
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.w_gate(x), self.w_up(x)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, rotary: RotaryEmbedding,
                 fused: bool = False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads, rotary, fused)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, ffn, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                 max_seq: int, tied: bool, checkpointed: bool = False, fused: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.embed = nn.Embedding(vocab, hidden)
        rotary = RotaryEmbedding(hidden // heads, max_seq)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn, rotary, fused) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
            # Rows of norm ~1 rather than ~sqrt(hidden): the tied head would start with huge logits.
            nn.init.normal_(self.embed.weight, std=hidden**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpointed and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)  # its forward runs again in backward
            else:
                x = layer(x)
        return self.head(self.norm(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    p.add_argument("--ffn", type=int, default=0, help="0: 8/3 x hidden, rounded up to 64")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--fused", action="store_true",
                   help="one projection for q, k and v and one for gate and up (split after the matmul)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward (torch.utils.checkpoint, use_reentrant=False)")
    p.add_argument("--compile", action="store_true",
                   help="compiled replay: forward and backward as torch.compile graphs with the dc ops inside "
                        "(dcplan.shard(compile=True)); with --no-shard, torch.compile on the model")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole step (forward, backward, optimizer) in one CUDA graph after two "
                        "warm-up steps and replay it (dcplan.graphed_step; GPU only)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3), help="ZeRO stage")
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype parameters are gathered and computed in")
    p.add_argument("--reduce-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms: runs repeat bit for bit on a GPU too (attention's "
                        "and the embedding's backward otherwise accumulate in an order that varies)")
    p.add_argument("--no-shard", action="store_true",
                   help="train the whole global batch in one process, without dcplan (the reference)")
    p.add_argument("--ranks", type=int, default=1,
                   help="with --no-shard: train the global batch of a run on this many ranks")
    p.add_argument("--losses", metavar="FILE", help="write the per-step losses to FILE as JSON")
    p.add_argument("--save", metavar="DIR",
                   help="after --save-at steps, save the model, the optimizer and the step in DIR "
                        "(torch.distributed.checkpoint, sharded), then go on")
    p.add_argument("--save-at", type=int, default=0, metavar="N",
                   help="with --save: the step count to save at (default: --steps)")
    p.add_argument("--resume", metavar="DIR",
                   help="load --save's checkpoint from DIR and go on from the step it was saved at")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="after every N-th step, an eval forward without grad on that step's first micro-batch "
                        "(not a training step: dcplan record does not count it)")
    args = p.parse_args(argv)
    if args.cuda_graph and (args.no_shard or args.device == "cpu"):
        p.error("--cuda-graph captures a dcplan-sharded step on a GPU: not with --no-shard or --device cpu")
    if (args.save or args.resume) and args.no_shard:
        p.error("--save and --resume checkpoint a dcplan-sharded model: not with --no-shard")
    if args.save_at and not args.save:
        p.error("--save-at says when --save saves; give --save DIR too")
    args.save_at = args.save_at or args.steps
    if args.save and not 0 < args.save_at <= args.steps:
        p.error(f"--save-at should be between 1 and --steps ({args.steps}), got {args.save_at}")
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    return args


def synthetic_batch(step: int, micro: int, sequences: int, seq: int, vocab: int, seed: int):
    """Walks of a fixed random successor table from random starts, with 10% random
    tokens: learnable, so the loss falls. The same on every rank."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro)
    data = torch.empty(sequences, seq + 1, dtype=torch.long)
    data[:, 0] = torch.randint(0, vocab, (sequences,), generator=g)
    noise = torch.rand(sequences, seq + 1, generator=g) < 0.1
    random_tokens = torch.randint(0, vocab, (sequences, seq + 1), generator=g)
    for t in range(1, seq + 1):
        data[:, t] = torch.where(noise[:, t], random_tokens[:, t], successor[data[:, t - 1]])
    return data[:, :-1], data[:, 1:]


def checkpoint_state(model, opt, step: int) -> dict:
    """What --save writes and --resume loads into: dcplan's sharded state dicts and the step count."""
    import dcplan

    return {"model": dcplan.get_model_state_dict(model), "optim": dcplan.get_optimizer_state_dict(model, opt),
            "step": torch.tensor(step)}


def resume(model, opt, path: str) -> int:
    """Loads --save's checkpoint at path into model and opt; returns the step count it was saved at."""
    import torch.distributed.checkpoint as dcp

    import dcplan

    state = checkpoint_state(model, opt, 0)
    dcp.load(state, checkpoint_id=path)
    dcplan.set_model_state_dict(model, state["model"])
    dcplan.set_optimizer_state_dict(model, opt, state["optim"])
    step = int(state["step"])
    del state
    gc.collect()  # DTensors hold reference cycles: their buffers would otherwise outlive the load
    return step


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = not args.no_shard and "WORLD_SIZE" in os.environ
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_llama.py: --device cuda, but torch sees no GPU")
    if distributed:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    ranks_in_batch = args.ranks if args.no_shard else world

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    ffn = args.ffn or (8 * args.hidden // 3 + 63) // 64 * 64
    model = Llama(args.vocab, args.hidden, args.layers, args.heads, args.kv_heads or args.heads, ffn, args.seq,
                  args.tied, args.activation_checkpointing, args.fused).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    param_dtype = getattr(torch, args.param_dtype)
    if args.no_shard:
        model = model.to(param_dtype) if param_dtype != torch.float32 else model
    else:
        import dcplan

        model = dcplan.shard(model, stage=args.stage, param_dtype=param_dtype if param_dtype != torch.float32
                             else None, reduce_dtype=getattr(torch, args.reduce_dtype), compile=args.compile)
    # A captured step's optimizer keeps its step count on the GPU (capturable), and is fused: the
    # capturable foreach AdamW ran 11 ms a step longer (2xH100, docs/benchmarks.md).
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, capturable=args.cuda_graph,
                            fused=args.cuda_graph or None)
    if args.compile and args.no_shard:
        model = torch.compile(model)

    if rank == 0:
        mode = "single process (no dcplan)" if args.no_shard else f"dcplan ZeRO-{args.stage} on {world} ranks"
        print(f"train_llama: {n_params / 1e6:.2f}M parameters, {args.layers} layers, hidden {args.hidden}, "
              f"{mode}, {device.type}, {args.param_dtype}", flush=True)
    def train_step(micro_batches):
        """One optimizer step over the micro-batches; returns this rank's loss (a tensor)."""
        step_loss = torch.zeros((), device=device)
        for micro, (inputs, targets) in enumerate(micro_batches):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(micro == args.grad_accum - 1)
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / args.grad_accum
            loss.backward()
            step_loss += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return step_loss

    first = resume(model, opt, args.resume) if args.resume else 0
    if rank == 0 and args.resume:
        print(f"resumed from {args.resume} at step {first}", flush=True)
    if args.save and args.save_at <= first:
        raise SystemExit(f"train_llama.py: --save-at {args.save_at} is at or before the step --resume starts at "
                         f"({first}): nothing would be saved")
    run_step = train_step
    if args.cuda_graph:
        import dcplan

        run_step = dcplan.graphed_step(train_step, warmup=2)
    losses = []
    for step in range(first, args.steps):
        start = time.perf_counter()
        micro_batches = []
        for micro in range(args.grad_accum):
            inputs, targets = synthetic_batch(step, micro, args.batch * ranks_in_batch, args.seq, args.vocab,
                                              args.seed)
            if not args.no_shard:
                inputs = inputs[rank * args.batch:(rank + 1) * args.batch]
                targets = targets[rank * args.batch:(rank + 1) * args.batch]
            micro_batches.append((inputs.to(device), targets.to(device)))
        step_loss = run_step(micro_batches).clone()  # a graph's output is overwritten by the next replay
        if distributed:  # the mean over ranks is the global batch's loss
            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        if use_cuda:
            torch.cuda.synchronize()
        value = float(step_loss)
        losses.append(value)
        if rank == 0:
            print(f"step {step:3d}  loss {value:.6f}  {1e3 * (time.perf_counter() - start):8.1f} ms", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            inputs, targets = micro_batches[0]
            model.eval()
            with torch.no_grad():
                eval_loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            model.train()
            if rank == 0:
                print(f"eval after step {step:3d}  loss {float(eval_loss):.6f}", flush=True)
        if args.save and step + 1 == args.save_at:
            import torch.distributed.checkpoint as dcp

            dcp.save(checkpoint_state(model, opt, step + 1), checkpoint_id=args.save)
            gc.collect()  # DTensors hold reference cycles: their buffers would otherwise outlive the save
            if rank == 0:
                print(f"saved {args.save} after step {step:3d}", flush=True)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump({"losses": losses}, f)
    if use_cuda:
        peak = torch.tensor(torch.cuda.max_memory_allocated(), device=device)
        if distributed:  # a budget holds on every rank: the most of them
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"peak memory: {int(peak)} bytes (torch.cuda.max_memory_allocated, the most over ranks)",
                  flush=True)
    if distributed:
        # Every rank done with every collective before any tears down its process group:
        # a rank that exits while a peer's Gloo threads still talk to it can abort the peer.
        dist.barrier()
        if not args.no_shard:
            import dcplan

            dcplan.shutdown()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())  # argparse errors and the end of a recording (DCPLAN_RECORD_EXIT=1) are SystemExit too
