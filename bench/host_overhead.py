#!/usr/bin/env python3
"""Host time per training step of FSDP2 and dcplan on CPU ranks: the per-op cost of the runtime.

    torchrun --nproc-per-node 2 bench/host_overhead.py            # 2 Gloo ranks
    torchrun --nproc-per-node 1 bench/host_overhead.py --layers 16 # one rank: no peer to wait for

The model has the module structure of the benchmark's Llama (examples/train_llama.py: 16
blocks of 9 parameters each by default) but a tiny width, so that a step's time is almost
all host work: Python hooks, dispatch, the runtime's bookkeeping and the collectives' fixed
costs. On the GPU machine's communication-heavy shape the host is the bottleneck for
both systems (docs/benchmarks.md), so this table predicts who wins there. Modes:

* plain  -- the unsharded model, no process group work (the model's own host cost);
* fsdp2  -- fully_shard per block and on the root (param_dtype bf16, reduce fp32);
* dcplan -- dcplan.shard(stage=3, param_dtype=bf16, reduce_dtype=fp32), default schedule
            (or --plan PLAN);
* dcplan-nocheck -- the same with DCPLAN_CHECK_COLLECTIVES=off: without the ranks' agreement
            on each collective (docs/runtime.md), which is one more small Gloo call each.

Prints the mean step time over --steps after --warmup (max over ranks) and the time above plain.
--rounds N runs the modes N times in turn (each round builds each mode afresh) and prints each
mode's median and its rounds: a host's speed drifts within minutes, and a comparison needs the
modes interleaved.
"""
import argparse
import gc
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from example_model import load_train_llama  # noqa: E402

MODES = ("plain", "fsdp2", "dcplan", "dcplan-nocheck")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times in turn (default 1)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--plan", help="dcplan: replay this plan")
    p.add_argument("--profile", metavar="FILE", help="rank 0: cProfile the dcplan mode's steps of the last round into FILE")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown mode(s) {', '.join(unknown)} ({', '.join(MODES)})")
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps should be at least 1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tl = load_train_llama()
    ffn = (8 * args.hidden // 3 + 63) // 64 * 64

    def make():
        torch.manual_seed(0)
        return tl.Llama(args.vocab, args.hidden, args.layers, args.heads, args.heads, ffn, args.seq, False)

    x, y = tl.synthetic_batch(0, 0, world, args.seq, args.vocab, 0)
    x, y = x[rank : rank + 1], y[rank : rank + 1]

    def timed(model, opt, autocast, profile=None):
        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x)
            F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        dist.barrier()
        prof = None
        if profile and rank == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        dt = (time.perf_counter() - t0) / args.steps
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def run(mode, profile):
        gc.collect()
        model = make()
        if mode == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return timed(model, opt, autocast=True)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return timed(model, opt, autocast=False)
        else:
            import dcplan

            kw = {"plan": args.plan} if args.plan else {}
            check = os.environ.get("DCPLAN_CHECK_COLLECTIVES")
            if mode == "dcplan-nocheck":
                os.environ["DCPLAN_CHECK_COLLECTIVES"] = "off"  # read by shard()
            try:
                model = dcplan.shard(model, stage=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **kw)
            finally:
                if check is None:
                    os.environ.pop("DCPLAN_CHECK_COLLECTIVES", None)
                else:
                    os.environ["DCPLAN_CHECK_COLLECTIVES"] = check
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            t = timed(model, opt, autocast=False, profile=profile)
            dcplan.shutdown()
            return t

    rounds = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes:
            last = r == args.rounds - 1
            rounds[mode].append(run(mode, profile=args.profile if last and mode == "dcplan" else None))
    results = {mode: statistics.median(ts) for mode, ts in rounds.items()}
    if rank == 0:
        n = sum(1 for _ in make().parameters())
        print(f"host time per step: {args.layers} layers, {n} parameters, hidden {args.hidden}, {world} Gloo ranks, "
              f"torch {torch.__version__}")
        print(f"{'mode':<15} {'step ms':>9} {'above plain':>12}" + ("  rounds (ms)" if args.rounds > 1 else ""))
        base = results.get("plain")
        for mode, t in results.items():
            extra = f"{1e3 * (t - base):12.2f}" if base is not None else f"{'-':>12}"
            each = "  " + ", ".join(f"{1e3 * r:.1f}" for r in rounds[mode]) if args.rounds > 1 else ""
            print(f"{mode:<15} {1e3 * t:9.2f} {extra}{each}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
