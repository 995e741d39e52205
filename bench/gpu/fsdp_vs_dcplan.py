#!/usr/bin/env python3
"""Step time of PyTorch FSDP2 and dcplan on the Llama-style model of examples/train_llama.py.

    torchrun --nproc-per-node 2 bench/gpu/fsdp_vs_dcplan.py --hidden 2048 --layers 16 --batch 1 --seq 1024
    torchrun --nproc-per-node 2 bench/gpu/fsdp_vs_dcplan.py ... --modes dcplan --plan plan.json

One process per GPU; every mode runs in the same processes, one after the other, on a fresh
model with the same initial weights, the same synthetic data (train_llama's), AdamW and the
same mixed precision: bf16 compute (param_dtype), fp32 master weights and fp32 gradient
reduction. Modes:

* fsdp2  -- torch.distributed.fsdp.fully_shard on every block and on the root,
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
* fsdp2-compiled -- as fsdp2, and torch.compile on every block (torchtitan's way);
* dcplan -- dcplan.shard(stage=3, param_dtype=bf16, reduce_dtype=fp32), default schedule, or
            the plan given by --plan (its predicted step time is printed beside the measured);
* dcplan-compiled -- as dcplan with compile=True (compiled replay: forward and backward as
            Inductor graphs with the dc ops inside), default schedule, or the plans given by
            --compiled-plan (made from a trace of the compiled model);
* deepspeed, deepcompile -- DeepSpeed ZeRO-3 (bf16, fp32 communication, torch AdamW), eager and
            with DeepCompile (compile.deepcompile, engine.compile()); not in a process with dcplan
            modes (both register torch.ops.dc): run in turn and combine with --merge;
* bound  -- the compute-only bound, on rank 0: forward+backward of the whole model in bf16 on
            one GPU without any communication, plus the AdamW step over this rank's 1/world
            share of the fp32 parameters.

Prints, per mode: step time (mean over --steps after --warmup, one synchronisation at each
end), tokens/s over all GPUs, peak memory (max over ranks, torch.cuda.max_memory_allocated, in
the steps; "setup": building the model on the device and sharding it, before them),
the ratio of the step time to the compute-only bound, and the first/last loss. --json FILE
writes the same as JSON. --rounds N runs the modes N times in turn and reports each mode's
median step time (the GPU machines' hosts vary from minute to minute, and these shapes
are host-bound). --merge FILE... prints the table of several such --json files (rounds run as
separate processes), each mode's rounds merged the same way.
"""
import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from example_model import load_train_llama  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="example", choices=("example", "transformers"),
                   help="example: train_llama's Llama (separate q, k, v, gate and up projections); transformers: "
                        "a LlamaForCausalLM built from a config of the same sizes (random init, sdpa attention, "
                        "untied head)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    p.add_argument("--ffn", type=int, default=0, help="0: 8/3 x hidden, rounded up to 64 (as train_llama)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes this many times in turn (A B C A B C ...) and report each mode's median")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--modes", default="fsdp2,dcplan,bound",
                   help="comma-separated: fsdp2, fsdp2-compiled, fsdp2-offload (CPUOffloadPolicy), dcplan, dcplan-compiled, dcplan-graphed, "
                        "dcplan-compiled-graphed (the whole step in a CUDA graph: dcplan.graphed_step), bound; a graphed "
                        "mode with +recipe (dcplan-compiled-graphed+recipe): clipping in the graph and a "
                        "warmup-cosine schedule of a tensor learning rate; +recipe-in-step: the same with the "
                        "clipping scale applied by the fused AdamW (clip_grad_norm_(..., optimizer=opt))")
    p.add_argument("--plan", help="dcplan: replay this plan (default schedule without); several: comma-separated, "
                   "one dcplan run each (dcplan:<file name> in the table)")
    p.add_argument("--compiled-plan", help="dcplan-compiled: replay these plans (comma-separated; "
                   "dcplan-compiled:<file name> in the table), each made from a trace of the compiled model")
    p.add_argument("--bucket-mb", type=float, default=0, help="dcplan reduce bucket in MB (0: dcplan's default)")
    p.add_argument("--adamw", default="foreach", choices=("foreach", "fused"),
                   help="dcplan modes' torch AdamW implementation (graphed: capturable either way)")
    p.add_argument("--label", default="", help="a name for this shape in the output")
    p.add_argument("--json", metavar="FILE", help="rank 0 writes the results here")
    p.add_argument("--memory-report", action="store_true",
                   help="rank 0: what is allocated when the optimizer step starts (the others by size and origin)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after timing, profile this many steps (torch.profiler) and print where the GPU time goes")
    p.add_argument("--trace-dir", help="rank 0 keeps its Chrome traces (--profile-steps) and host profiles "
                   "(--host-profile-steps) here")
    p.add_argument("--host-profile-steps", type=int, default=0,
                   help="after timing, run this many steps under cProfile on rank 0 and print where the host "
                        "time goes (the communication-heavy shape is bound by the host)")
    return p.parse_args()


class LogitsOf(torch.nn.Module):
    """A transformers causal LM as the bench calls its models: token ids in, logits out."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    @property
    def layers(self):  # the decoder blocks, which FSDP2 shards one by one (not a second registration)
        return self.lm.model.layers

    def forward(self, ids):
        return self.lm(input_ids=ids, use_cache=False).logits


class Bench:
    def __init__(self, args):
        self.args = args
        self.tl = load_train_llama()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        a = args
        self.ffn = a.ffn or (8 * a.hidden // 3 + 63) // 64 * 64
        total = a.warmup + a.steps
        # train_llama's data: one global batch per step, this rank's slice; made up front.
        self.batches = []
        for step in range(total):
            x, y = self.tl.synthetic_batch(step, 0, a.batch * self.world, a.seq, a.vocab, 0)
            sl = slice(self.rank * a.batch, (self.rank + 1) * a.batch)
            self.batches.append((x[sl].to(self.device), y[sl].to(self.device)))

    def model(self):
        a = self.args
        torch.manual_seed(0)
        if a.model == "transformers":
            import transformers as tf

            config = tf.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=self.ffn,
                                    num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                    num_key_value_heads=a.kv_heads or a.heads, max_position_embeddings=a.seq,
                                    tie_word_embeddings=False, attn_implementation="sdpa")
            return LogitsOf(tf.LlamaForCausalLM(config)).to(self.device)
        return self.tl.Llama(a.vocab, a.hidden, a.layers, a.heads, a.kv_heads or a.heads, self.ffn, a.seq,
                             False).to(self.device)

    def run(self, model, opt, mode, update=None, train_step=None):
        """update(loss): backward and optimizer step (default: loss.backward(), opt.step(), zero_grad);
        train_step(x, y) -> loss: the whole step instead (a graphed step)."""
        a = self.args
        losses = []

        def default_update(loss):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def step(i):
            x, y = self.batches[i]
            if train_step is not None:
                losses.append(train_step(x, y).clone())  # a graph's output: overwritten by the next call
                return
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            (update or default_update)(loss)
            losses.append(loss.detach())

        # The setup (the whole model built on the device, then sharded) has its own peak, which
        # hid the steps' of modes that hold less (docs/benchmarks.md, Planned offload): the steps'
        # peak starts here.
        self.setup_peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for i in range(a.warmup):
            step(i)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(a.warmup, a.warmup + a.steps):
            step(i)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        trained = [float(v) for v in torch.stack(losses).cpu()]  # the steps below train on: not reported
        self.run_peak = torch.cuda.max_memory_allocated(self.device)  # before the phases reset it
        # By phase only where forward, backward and step are the plain calls (not DeepSpeed's engine).
        self.phase_peaks = self.peaks_by_phase(model, opt, mode) if update is None and train_step is None else None
        self.breakdown = self.profile(step, mode) if a.profile_steps else None
        if a.host_profile_steps:
            self.host_profile(step, mode)
        return elapsed / a.steps, trained

    def peaks_by_phase(self, model, opt, mode):
        """Peak memory (GiB, this rank) within forward, backward and the optimizer step of one more
        step: which phase sets a mode's peak (the optimizer's is the same for every mode)."""
        x, y = self.batches[0]
        peaks = {}

        def phase(name, fn):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            out = fn()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated(self.device) / 2**30
            return out

        if self.args.memory_report:
            torch.cuda.memory._record_memory_history(max_entries=100000)
        loss = phase("forward", lambda: F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()))
        phase("backward", loss.backward)
        if self.args.memory_report:
            try:
                self.memory_report(model, opt, mode)
            except Exception as e:  # a diagnostic: the benchmark goes on without it
                print(f"{mode}: memory report failed: {type(e).__name__}: {e}", flush=True)
            torch.cuda.memory._record_memory_history(enabled=None)
        phase("optimizer", opt.step)
        opt.zero_grad(set_to_none=True)
        return peaks

    def memory_report(self, model, opt, mode):
        """Rank 0: what is allocated when the optimizer step starts: parameters, gradients and
        optimizer state, and the other blocks (largest first, where they were allocated)."""
        if self.rank != 0:
            return
        torch.cuda.synchronize()

        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        known = {}
        for p in model.parameters():
            known[local(p).untyped_storage().data_ptr()] = "param"
            if p.grad is not None:
                known[local(p.grad).untyped_storage().data_ptr()] = "grad"
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.is_cuda:
                    known[local(v).untyped_storage().data_ptr()] = "optimizer state"
        sums, others = {}, []
        for seg in torch.cuda.memory._snapshot()["segments"]:
            for blk in seg["blocks"]:
                if blk["state"] != "active_allocated":
                    continue
                kind = known.get(blk["address"])
                if kind is None:
                    others.append(blk)
                    kind = "other"
                sums[kind] = sums.get(kind, 0) + blk["size"]
        total = torch.cuda.memory_allocated(self.device)
        print(f"{mode}: allocated when the optimizer step starts {total / 2**20:.1f} MiB: "
              + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(sums.items())), flush=True)
        for blk in sorted(others, key=lambda b: -b["size"])[:8]:
            frames = [f for f in blk.get("frames", []) if f.get("filename", "").endswith(".py")][:3]
            where = "; ".join(f"{pathlib.Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
            print(f"  other block {blk['size'] / 2**20:8.2f} MiB  {where or '(allocated before the report step)'}",
                  flush=True)

    def profile(self, step, mode):
        """Kernel time per step from a torch.profiler trace: compute, communication (NCCL
        kernels), their overlap, communication not hidden behind compute, and GPU idle time."""
        from torch.profiler import ProfilerActivity, profile

        a = self.args
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(a.profile_steps):
                step(i % len(self.batches))
            torch.cuda.synchronize()
        path = os.path.join(a.trace_dir or "/tmp", f"{a.label or 'shape'}-{mode}-rank{self.rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if not (a.trace_dir and self.rank == 0):
            os.remove(path)
        kernels = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"].lower()) for e in events
                   if e.get("cat") == "kernel" and e.get("dur", 0) > 0]
        if not kernels:
            return None

        def union(iv):
            iv = sorted(iv)
            out = []
            for lo, hi in iv:
                if out and lo <= out[-1][1]:
                    out[-1][1] = max(out[-1][1], hi)
                else:
                    out.append([lo, hi])
            return out

        def length(iv):
            return sum(hi - lo for lo, hi in iv)

        def intersect(x, y):
            i = j = 0
            out = 0.0
            while i < len(x) and j < len(y):
                lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
                out += max(0.0, hi - lo)
                if x[i][1] < y[j][1]:
                    i += 1
                else:
                    j += 1
            return out

        comp = union([(lo, hi) for lo, hi, nccl in kernels if not nccl])
        comm = union([(lo, hi) for lo, hi, nccl in kernels if nccl])
        window = max(hi for _, hi, _ in kernels) - min(lo for lo, _, _ in kernels)
        busy = length(union([(lo, hi) for lo, hi, _ in kernels]))
        overlap = intersect(comp, comm)
        n = a.profile_steps * 1e3  # us -> ms per step
        return {"compute_ms": length(comp) / n, "comm_ms": length(comm) / n, "overlap_ms": overlap / n,
                "exposed_comm_ms": (length(comm) - overlap) / n, "idle_ms": (window - busy) / n,
                "window_ms": window / n}

    def host_profile(self, step, mode):
        """Rank 0's host time by function over --host-profile-steps steps (cProfile, own time)."""
        import cProfile
        import io
        import pstats

        a = self.args
        torch.cuda.synchronize()
        prof = cProfile.Profile() if self.rank == 0 else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        for i in range(a.host_profile_steps):
            step(i % len(self.batches))
        host = (time.perf_counter() - t0) / a.host_profile_steps
        torch.cuda.synchronize()
        if prof:
            prof.disable()
            if a.trace_dir:  # the whole profile, for pstats
                prof.dump_stats(os.path.join(a.trace_dir, f"{a.label or 'shape'}-{mode}-host.prof"))
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
            lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
            lines = lines[next((k for k, ln in enumerate(lines) if ln.split()[:1] == ["ncalls"]), 0):]
            print(f"{a.label} {mode}: host time by function, rank 0, {a.host_profile_steps} steps "
                  f"({1e3 * host:.1f} ms a step issued under the profiler)\n" + "\n".join(lines[:24]), flush=True)

    def measured(self, step, losses):
        """What every mode reports after run(): the slowest rank's step, the most memory over the
        ranks in the steps and in the setup before them (one all-reduce), the losses, the profiles."""
        most = torch.tensor([step, self.run_peak, self.setup_peak], device=self.device, dtype=torch.float64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        step_s, peak, setup = most.tolist()
        return {"step_s": step_s, "peak_bytes": int(peak), "setup_peak_bytes": int(setup), "losses": losses,
                "breakdown": self.breakdown, "phase_peaks_gib": self.phase_peaks}

    def fresh(self):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def fsdp2(self, compiled=False, offload=False):
        """offload: FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state on the host, the
        optimizer stepping there), the baseline of dcplan's planned offload."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.fresh()
        torch._dynamo.reset()
        model = self.model()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = CPUOffloadPolicy() if offload else OffloadPolicy()
        for block in model.layers:
            fully_shard(block, mp_policy=mp, offload_policy=policy)
            if compiled:
                block.compile()
        fully_shard(model, mp_policy=mp, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=self.args.lr, weight_decay=0.01)
        step, losses = self.run(model, opt, "fsdp2-compiled" if compiled else "fsdp2-offload" if offload else "fsdp2")
        out = self.measured(step, losses)
        del model, opt
        return out

    def deepspeed(self, compiled=False):
        """DeepSpeed ZeRO-3 (bf16 on, fp32 communication, torch AdamW); compiled: DeepCompile
        (compile.deepcompile, engine.compile()), whose passes run at step 5: time it after at
        least 12 warm-up steps (--warmup)."""
        import deepspeed

        self.fresh()
        torch._dynamo.reset()
        model = self.model()
        opt = torch.optim.AdamW(model.parameters(), lr=self.args.lr, weight_decay=0.01)
        config = {"train_micro_batch_size_per_gpu": self.args.batch, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": True}, "communication_data_type": "fp32",
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                  "compile": {"deepcompile": compiled}}
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        if compiled:
            engine.compile()

        def update(loss):
            engine.backward(loss)
            engine.step()

        mode = "deepcompile" if compiled else "deepspeed"
        step, losses = self.run(engine, opt, mode, update)
        out = dict(self.measured(step, losses), deepspeed=deepspeed.__version__)
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model, opt
        return out

    def dcplan(self, plan=None, compiled=False, graphed=False, recipe=None):
        """graphed: the whole step captured in a CUDA graph (dcplan.graphed_step, two warm-up calls
        and the capture within --warmup), with a capturable AdamW. recipe (graphed): a real run's
        step: clipping inside the graph (dcplan.clip_grad_norm_, max norm 1; "in-step": its scale
        applied by the fused AdamW) and a tensor learning rate that a warmup-cosine schedule fills
        between the replays."""
        import dcplan

        self.fresh()
        torch._dynamo.reset()
        model = self.model()
        kw = {}
        if self.args.bucket_mb:
            kw["reduce_bucket_bytes"] = int(self.args.bucket_mb * 1e6)
        if plan:
            kw["plan"] = plan
        model = dcplan.shard(model, stage=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                             compile=compiled, **kw)
        lr = torch.tensor(self.args.lr, device=self.device) if recipe else self.args.lr
        # Named explicitly: fused=False alone makes torch take its per-tensor loop, not foreach
        # (which the dcplan modes ran until 2026-11-27 while fsdp2 and the bound ran foreach).
        impl = {"fused": True} if self.args.adamw == "fused" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, capturable=graphed, **impl)
        mode = ("dcplan-compiled" if compiled else "dcplan") + ("-graphed" if graphed else "")
        train_step = graphed_step = None
        if graphed:
            if self.args.warmup < 3:
                sys.exit("fsdp_vs_dcplan: graphed modes need --warmup >= 3 (two warm-up calls, then the capture)")

            def one_step(x, y):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                loss.backward()
                if recipe:
                    # +recipe-in-step: the fused AdamW applies the clipping scale as it reads the gradients
                    dcplan.clip_grad_norm_(model, 1.0, optimizer=opt if recipe == "in-step" else None)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            graphed_step = dcplan.graphed_step(one_step, warmup=2)
            train_step = self.timed_capture(graphed_step, opt if recipe else None)
        step, losses = self.run(model, opt, mode, train_step=train_step)
        out = self.measured(step, losses)
        if graphed:
            out["capture_s"] = self.capture_s
        if plan:
            with open(plan) as f:
                doc = json.load(f)
            out["predicted_step_s"] = doc["predicted"]["step_us"] * 1e-6
            out["predicted_peak_bytes"] = doc["predicted"]["peak_memory_bytes"]
            out["plan"] = plan
            if "copy_bound_us" in doc["predicted"]:  # an offload's copy bound, and its parts
                out["copy_bound"] = {k[:-3] + "_s": doc["predicted"][k] * 1e-6 for k in
                                     ("copy_in_us", "copy_out_us", "unconstrained_step_us", "copy_bound_us")}
        if graphed_step is not None:
            graphed_step.close()
        del model, opt, train_step, graphed_step
        dcplan.shutdown()
        return out

    def timed_capture(self, graphed_step, scheduled_opt=None):
        """graphed_step(x, y), with the call that captures timed (self.capture_s) and, for an
        optimizer given, a warmup-cosine schedule stepped after every call (outside the graph)."""
        import math

        sched = None
        if scheduled_opt is not None:
            total = self.args.warmup + self.args.steps
            sched = torch.optim.lr_scheduler.LambdaLR(
                scheduled_opt, lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * s / (total + 1))))
        self.capture_s = None

        def call(x, y):
            capturing = graphed_step.next_call_captures
            if capturing:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = graphed_step(x, y)
            if capturing:
                torch.cuda.synchronize()
                self.capture_s = time.perf_counter() - t0
            if sched is not None:
                sched.step()
            return out

        return call

    def bound(self):
        """Compute-only bound on rank 0 (the other ranks wait)."""
        a = self.args
        out = {}
        if self.rank == 0:
            self.fresh()
            model = self.model().to(torch.bfloat16)
            numels = [p.numel() for p in model.parameters()]
            shards = [torch.zeros(-(-n // self.world), device=self.device, requires_grad=True) for n in numels]
            for s in shards:
                s.grad = torch.randn_like(s) * 1e-3
            opt = torch.optim.AdamW(shards, lr=a.lr, weight_decay=0.01)

            def fwd_bwd(i):
                x, y = self.batches[i]
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                loss.backward()
                for p in model.parameters():
                    p.grad = None

            def timed(fn):
                for i in range(a.warmup):
                    fn(i)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(a.warmup, a.warmup + a.steps):
                    fn(i)
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / a.steps

            fb = timed(fwd_bwd)
            st = timed(lambda i: opt.step())
            out = {"step_s": fb + st, "fwd_bwd_s": fb, "optimizer_s": st,
                   "peak_bytes": torch.cuda.max_memory_allocated(self.device)}
            del model, opt, shards
        dist.barrier()
        return out


def merge_rounds(rs):
    """One mode's results over the rounds: the median step time (the hosts of the GPU machine
    vary from minute to minute), the highest peaks (steps, setup), the rest from the last round."""
    r = dict(rs[-1])
    if len(rs) > 1 and all("step_s" in x for x in rs):
        r["round_step_s"] = [x["step_s"] for x in rs]
        r["step_s"] = statistics.median(r["round_step_s"])
        for key in ("peak_bytes", "setup_peak_bytes"):
            if all(key in x for x in rs):
                r[key] = max(x[key] for x in rs)
    return r


def report(results, meta):
    """The table of results (mode -> merged result) for meta: the shape, the machine, the versions."""
    a = argparse.Namespace(**meta["args"])
    world = meta["world"]
    tokens = a.batch * a.seq * world
    model = "transformers LlamaForCausalLM, " if getattr(a, "model", "example") == "transformers" else ""
    print(f"{a.label or 'shape'}: {model}{meta['params'] / 1e6:.0f}M parameters, hidden {a.hidden}, {a.layers} layers, "
          f"{a.batch}x{a.seq} tokens per GPU, {world} GPUs ({meta['device']}), torch {meta['torch']}")
    bound = results.get("bound", {}).get("step_s")
    width = max(8, *(len(m) for m in results))
    print(f"{'mode':<{width}} {'step ms':>9} {'tokens/s':>10} {'peak GiB':>9} {'setup GiB':>9} {'x bound':>8} {'pred ms':>8} "
          f"{'pred GiB':>8} {'loss first/last':>16}")
    for mode, r in results.items():
        ratio = f"{r['step_s'] / bound:8.2f}" if bound else f"{'-':>8}"
        pred = f"{1e3 * r['predicted_step_s']:8.1f}" if "predicted_step_s" in r else f"{'-':>8}"
        pred += f" {r['predicted_peak_bytes'] / 2**30:8.2f}" if "predicted_peak_bytes" in r else f" {'-':>8}"
        losses = r.get("losses")
        loss = f"{losses[0]:7.3f}/{losses[-1]:7.3f}" if losses else f"{'-':>16}"
        setup = f"{r['setup_peak_bytes'] / 2**30:9.2f}" if "setup_peak_bytes" in r else f"{'-':>9}"
        print(f"{mode:<{width}} {1e3 * r['step_s']:9.1f} {tokens / r['step_s']:10.0f} {r['peak_bytes'] / 2**30:9.2f} "
              f"{setup} {ratio} {pred} {loss}")
    for mode, r in results.items():
        ph = r.get("phase_peaks_gib")
        if ph:
            print(f"{mode:<{width}} rank-0 peak GiB by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    for mode, r in results.items():
        b = r.get("breakdown")
        if b:
            print(f"{mode:<{width}} rank-0 GPU time per step (ms): compute {b['compute_ms']:.1f}, NCCL {b['comm_ms']:.1f} "
                  f"(overlapped {b['overlap_ms']:.1f}, exposed {b['exposed_comm_ms']:.1f}), idle {b['idle_ms']:.1f}, "
                  f"window {b['window_ms']:.1f}")
    for mode, r in results.items():
        if r.get("capture_s") is not None:
            print(f"{mode:<{width}} capture (the third call) took {r['capture_s']:.1f} s")
    for mode, r in results.items():
        if "round_step_s" in r:
            print(f"{mode:<{width}} step ms in each round: "
                  + ", ".join(f"{1e3 * t:.1f}" for t in r["round_step_s"]) + " (the table: their median)")
    print_copy_bounds(results, width)
    if "bound" in results:
        b = results["bound"]
        print(f"bound = fwd+bwd {1e3 * b['fwd_bwd_s']:.1f} ms + optimizer {1e3 * b['optimizer_s']:.1f} ms")


def print_copy_bounds(results, width):
    """Each offload plan's step against its copy bound (issue 30): the longest of the step without a
    budget, measured ("dcplan:free", the offload target's plan without one; else the plan's own
    prediction of it), and the plan's copies in and out per step at the planned host-link rates."""
    free = results.get("dcplan:free", {}).get("step_s")
    for mode, r in results.items():
        b = r.get("copy_bound")
        if not b:
            continue
        unconstrained, which = (free, "dcplan:free measured") if free else (b["unconstrained_step_s"], "predicted")
        bound = max(unconstrained, b["copy_in_s"], b["copy_out_s"])
        print(f"{mode:<{width}} copy bound {1e3 * bound:.1f} ms = max(the step without a budget {1e3 * unconstrained:.1f} "
              f"ms ({which}), copies in {1e3 * b['copy_in_s']:.1f} ms, out {1e3 * b['copy_out_s']:.1f} ms): step "
              f"{r['step_s'] / bound:.2f}x it (the plan's own bound: {1e3 * b['copy_bound_s']:.1f} ms)")


def merge_files(paths):
    """--merge: the --json files of several runs of one shape (rounds run as separate processes,
    as DeepSpeed's modes must: its op library registers torch.ops.dc, as dcplan's does), each
    mode's rounds merged as --rounds does."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
        if "world" not in docs[-1]:
            sys.exit(f"fsdp_vs_dcplan --merge: {p}: no 'world' field (written before --merge existed)")
    runs = {}
    for d in docs:
        for mode, r in d["results"].items():
            runs.setdefault(mode, []).extend(
                [dict(r, step_s=t) for t in r["round_step_s"]] if "round_step_s" in r else [r])
    report({mode: merge_rounds(rs) for mode, rs in runs.items()}, docs[0])


def recipe_of(mode: str):
    """A graphed mode's recipe suffix: "+recipe" (clipping scales the gradients itself) or
    "+recipe-in-step" (the fused AdamW applies the scale); None without one."""
    base, _, suffix = mode.partition("+")
    if suffix not in ("", "recipe", "recipe-in-step"):
        sys.exit(f"fsdp_vs_dcplan: mode {mode}: the suffix should be +recipe or +recipe-in-step")
    if suffix and not base.endswith("-graphed"):
        sys.exit(f"fsdp_vs_dcplan: mode {mode}: +{suffix} is for the graphed modes (dcplan-graphed, "
                 "dcplan-compiled-graphed)")
    return {"": None, "recipe": "in-pass", "recipe-in-step": "in-step"}[suffix]


def plans_for(plans, graphed: bool) -> list:
    """The plans of a comma-separated list made for this kind of replay (options.cuda_graph): the
    runtime refuses a plan for one CUDA graph outside dcplan.graphed_step, and the other way round."""
    out = []
    for plan in plans.split(",") if plans else []:
        with open(plan) as f:
            if json.load(f)["options"].get("cuda_graph", False) == graphed:
                out.append(plan)
    return out


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--merge":
        merge_files(sys.argv[2:])
        return
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    args = parse_args()
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)  # a crash names its C++ frames
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    modes = args.modes.split(",")
    ds = [m for m in modes if m in ("deepspeed", "deepcompile")]
    if ds and len(ds) != len(modes) and any(m.startswith("dcplan") for m in modes):
        sys.exit("fsdp_vs_dcplan: deepspeed/deepcompile and dcplan modes cannot share a process (both register "
                 "torch.ops.dc); run them in turn in separate processes and combine the --json files with --merge")
    bench = Bench(args)
    runs = {}  # mode -> its result in each round
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            if mode == "dcplan" and args.plan:
                for plan in plans_for(args.plan, False):
                    name = "dcplan:" + os.path.basename(plan).removesuffix(".json")
                    runs.setdefault(name, []).append(bench.dcplan(plan))
            elif mode.split("+")[0] in ("dcplan-compiled", "dcplan-compiled-graphed"):
                graphed = "-graphed" in mode
                for plan in [None] + plans_for(args.compiled_plan, graphed):
                    name = mode + (":" + os.path.basename(plan).removesuffix(".json") if plan else "")
                    runs.setdefault(name, []).append(
                        bench.dcplan(plan, compiled=True, graphed=graphed, recipe=recipe_of(mode)))
            elif mode.split("+")[0] == "dcplan-graphed":
                for plan in [None] + plans_for(args.plan, True):
                    name = mode + (":" + os.path.basename(plan).removesuffix(".json") if plan else "")
                    runs.setdefault(name, []).append(bench.dcplan(plan, graphed=True, recipe=recipe_of(mode)))
            elif mode in ("fsdp2-compiled", "fsdp2-offload"):
                runs.setdefault(mode, []).append(bench.fsdp2(compiled=mode == "fsdp2-compiled",
                                                             offload=mode == "fsdp2-offload"))
            elif mode in ("deepspeed", "deepcompile"):
                runs.setdefault(mode, []).append(bench.deepspeed(compiled=mode == "deepcompile"))
            else:
                runs.setdefault(mode, []).append(getattr(bench, mode)())
    results = {mode: merge_rounds(rs) for mode, rs in runs.items()}
    if bench.rank == 0:
        meta = {"args": vars(args), "params": sum(p.numel() for p in bench.model().parameters()),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "world": bench.world}
        report(results, meta)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
