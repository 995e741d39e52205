#!/usr/bin/env python3
"""Trains a transformers LlamaForCausalLM (built from a config: random init, no download) with
dcplan, and checkpoints it halfway: a sharded save through torch.distributed.checkpoint, a new
model and optimizer, a load, and the rest of the steps.

    torchrun --standalone --nproc-per-node 2 examples/train_transformers.py              # CPU ranks
    torchrun --nproc-per-node 2 examples/train_transformers.py --device cuda --hidden 2048 --layers 16
    torchrun --nproc-per-node 2 examples/train_transformers.py --device cuda --compile --graphed --accum 2

The recipe is a real run's: gradient accumulation inside the step (--accum), clipping
(dcplan.clip_grad_norm_), AdamW with a tensor learning rate that a warmup-cosine schedule updates
in place (--warmup-steps), an eval forward every --eval-every steps, and the checkpoint. With
--compile --graphed (a GPU) the whole step runs as one CUDA graph (dcplan.graphed_step): the same
step function, captured after two warm-up calls and replayed; AdamW is then fused and capturable.

--check-resume also trains the same steps without the checkpoint, in the same processes, and
says whether the losses after the load are the same numbers (on GPUs with --attn eager: sdpa's
flash-attention backward accumulates in a varying order, so two straight runs differ as well).
--save-pretrained DIR writes the gathered full state dict in transformers' format at the end
(rank 0). Rank 0 prints one line per step.
"""
import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcplan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-at", type=int, default=10, help="the step after which to save and load")
    p.add_argument("--checkpoint-dir", default="", help="default: a temporary directory")
    p.add_argument("--check-resume", action="store_true", help="also train straight through and compare")
    p.add_argument("--save-pretrained", default="", help="directory for the final model (transformers format)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="compiled replay (dcplan.shard(compile=True))")
    p.add_argument("--graphed", action="store_true", help="the whole step as one CUDA graph (dcplan.graphed_step)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (inside the step)")
    p.add_argument("--warmup-steps", type=int, default=2, help="linear warmup, then a cosine to 0 at --steps")
    p.add_argument("--eval-every", type=int, default=5, help="an eval forward (no grad) every N steps; 0: none")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"),
                   help="attention implementation (eager: deterministic on GPUs, for --check-resume)")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (dcplan.clip_grad_norm_)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return p.parse_args(argv)


def build(args, device, seed):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                            attn_implementation=args.attn)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).to(device)
    if args.activation_checkpointing:  # torch.utils.checkpoint around each decoder layer
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x names it so
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    param_dtype = torch.bfloat16 if args.param_dtype == "bfloat16" else None
    dcplan.shard(model, stage=args.stage, param_dtype=param_dtype, reduce_dtype=torch.float32, compile=args.compile)
    # A tensor learning rate: the schedule fills it in place, which a captured step reads at each
    # replay (a float would be baked into the graph). capturable and fused: what a graph needs.
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(args.lr, device=device), weight_decay=0.01,
                            capturable=cuda, fused=cuda or None, foreach=False if not cuda else None)
    for group in opt.param_groups:
        group["initial_lr"] = args.lr  # the schedule's base, in the checkpoint from the start (schedule())
    return model, opt


def warmup_cosine(args):
    """The learning rate's factor at step s: linear warmup over --warmup-steps, then a cosine to 0."""
    def factor(s):
        if s < args.warmup_steps:
            return (s + 1) / args.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (s - args.warmup_steps) / max(1, args.steps - args.warmup_steps)))
    return factor


def schedule(opt, args, start):
    """The schedule of a run that resumes at step `start` (0: a fresh one); it depends only on the
    step, so a resumed run needs no scheduler state: the param groups keep initial_lr (build())."""
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args), last_epoch=start - 1)


def make_step(model, opt, args):
    """One optimizer step over --accum micro-batches: returns [loss, gradient norm] as one tensor
    (no host synchronisation inside, so that it can be captured)."""
    def step(micro):
        total = torch.zeros((), device=micro[0].device)
        for m, ids in enumerate(micro):
            model.set_requires_gradient_sync(m == len(micro) - 1)
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += loss.detach()
        # A fused AdamW (on a GPU) applies the clipping scale as it reads the gradients: one pass less.
        norm = dcplan.clip_grad_norm_(model, args.max_norm, optimizer=opt if opt.defaults.get("fused") else None)
        opt.step()
        opt.zero_grad()
        return torch.stack([total, norm.to(total.dtype)])
    return dcplan.graphed_step(step, warmup=2) if args.graphed else step


def batch(args, step, rank, device, micro=0):
    """This rank's slice of a micro-batch of step's global batch (deterministic: the same for every run)."""
    g = torch.Generator().manual_seed(1000 + step * args.accum + micro)
    ids = torch.randint(0, args.vocab, (args.batch * dist.get_world_size(), args.seq), generator=g)
    return ids[rank * args.batch:(rank + 1) * args.batch].to(device)


def evaluate(model, args, rank, device):
    """The loss on a held-out batch, without grad (between graphed steps: run eagerly)."""
    model.eval()
    with torch.no_grad():
        ids = batch(args, -1, rank, device)
        loss = model(input_ids=ids, labels=ids).loss.float()
    model.train()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def memory(device):
    """What this process holds now: allocated GPU memory (on a GPU) and the host's resident set."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    gpu = f"allocated {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB, " if device.type == "cuda" else ""
    return f"({gpu}host RSS {rss / 2**20:.1f} MiB)"


def train(model, opt, args, steps, rank, device, label):
    losses = []
    step_fn = make_step(model, opt, args)
    sched = schedule(opt, args, steps.start)
    for step in steps:
        t0 = time.perf_counter()
        out = step_fn([batch(args, step, rank, device, m) for m in range(args.accum)])
        sched.step()
        total = out[0].detach().float().clone()  # a graphed step's output is overwritten by its next call
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        if rank == 0:
            print(f"{label} step {step:3d}  loss {losses[-1]:.6f}  norm {out[1].item():.4f}  "
                  f"{1e3 * (time.perf_counter() - t0):8.1f} ms", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            ev = evaluate(model, args, rank, device)
            if rank == 0:
                print(f"{label} eval after step {step:3d}  loss {ev:.6f}  {memory(device)}", flush=True)
    if args.graphed:
        step_fn.close()  # the model may run outside the graph again (a save, a new step function)
    return losses


def state(model, opt):
    return {"model": dcplan.get_model_state_dict(model), "optim": dcplan.get_optimizer_state_dict(model, opt)}


def snapshot(sd):
    """This rank's values of a state dict, on the host: tensors (their local shards) and the rest."""
    leaves, _ = torch.utils._pytree.tree_flatten(sd)
    local = [leaf.to_local() if hasattr(leaf, "to_local") else leaf for leaf in leaves]
    return [leaf.detach().cpu().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in local]


def same_values(a, b):
    """Bit for bit (a resumed run starts from exactly the state that was saved)."""
    return len(a) == len(b) and all(
        (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y))
        or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a, b))


def main(argv=None):
    args = parse_args(argv)
    if not 0 < args.save_at < args.steps:
        sys.exit(f"train_transformers: --save-at should be between 0 and --steps ({args.steps}), got {args.save_at}")
    if args.accum < 1:
        sys.exit(f"train_transformers: --accum should be >= 1, got {args.accum}")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.graphed and not cuda:
        sys.exit("train_transformers: --graphed captures the step in a CUDA graph; it needs a GPU (--device cuda)")
    if args.graphed and not args.compile:
        # Measured with transformers' LlamaForCausalLM (1xH100): its eager forward copies a host tensor
        # to the GPU, which a capture refuses; its compiled forward does not.
        sys.exit("train_transformers: --graphed needs --compile: transformers' eager forward copies a host tensor to "
                 "the GPU, which a CUDA graph capture refuses")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ckpt_root = [args.checkpoint_dir or (tempfile.mkdtemp(prefix="dcplan-ckpt-") if rank == 0 else None)]
    dist.broadcast_object_list(ckpt_root, group_src=0)  # one directory for every rank (one machine)
    ckpt_root = ckpt_root[0]
    path = os.path.join(ckpt_root, f"step{args.save_at}")

    model, opt = build(args, device, seed=0)
    losses = train(model, opt, args, range(args.save_at), rank, device, "train")
    saved = state(model, opt)
    before = snapshot(saved)
    dcp.save(saved, checkpoint_id=path)
    if rank == 0:
        print(f"saved {path} (torch.distributed.checkpoint, {dist.get_world_size()} ranks)", flush=True)
    del model, opt

    model, opt = build(args, device, seed=1)  # other values: only the load makes them right
    sd = state(model, opt)
    dcp.load(sd, checkpoint_id=path)
    dcplan.set_model_state_dict(model, sd["model"])
    dcplan.set_optimizer_state_dict(model, opt, sd["optim"])
    restored = same_values(before, snapshot(state(model, opt)))
    if rank == 0:
        print(f"loaded {path} into a new model and optimizer; its state equals the saved one bit for bit: "
              f"{'yes' if restored else 'NO'}", flush=True)
    losses += train(model, opt, args, range(args.save_at, args.steps), rank, device, "train")

    if args.save_pretrained:
        full = dcplan.get_model_state_dict(model, options=dcplan.StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if rank == 0:
            model.save_pretrained(args.save_pretrained, state_dict=full)
            print(f"saved {args.save_pretrained} (save_pretrained of the full state dict)", flush=True)
    code = 0
    if args.check_resume:
        del model, opt
        model, opt = build(args, device, seed=0)
        straight = train(model, opt, args, range(args.steps), rank, device, "straight")
        same = straight == losses and restored
        if rank == 0:
            print(f"resume exact: {'yes' if same else 'NO'} ({args.steps - args.save_at} steps after the load)")
            if not same:
                for s, (a, b) in enumerate(zip(straight, losses)):
                    print(f"  step {s:3d}  straight {a:.9f}  resumed {b:.9f}")
        code = 0 if same else 1
    if rank == 0 and torch.cuda.is_available() and cuda:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
