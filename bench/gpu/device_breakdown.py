#!/usr/bin/env python3
"""Where a graphed dcplan step's device time goes, against what the device itself bounds.

    torchrun --nproc-per-node 1 bench/gpu/device_breakdown.py --batch 1 --seq 1024 --compiled-plan graph.json \
        --warmup 8 --steps 20 --profile-steps 5

The bench's model (fsdp_vs_dcplan.py's arguments; its other options apply too) runs as
dcplan-compiled-graphed: compile=True and the whole step in one CUDA graph (dcplan.graphed_step),
with the plan given by --compiled-plan (default schedule without), twice in one process: with
torch's capturable AdamW as the bench uses it (foreach) and with fused=True. After the timed steps,
--profile-steps steps (default 5) run under torch.profiler (Kineto), and rank 0 prints the
kernels' time per step by category: model compute (matmul, attention, pointwise and reductions),
casts, copies, optimizer, collectives, memset and fills, and the idle time of the device between
the first and the last kernel. A category's time is the union of its kernels' intervals, so
kernels of one category that overlap (two streams) count once; collectives also show the part
no compute kernel overlaps (exposed). The names of the kernels with the most time follow, with
their category, so that the sorting can be checked.

Then the device's own bounds, each as kernel time (Kineto: the union of the kernels' intervals
per step, so a slow host cannot inflate it), on rank 0 while the others wait:
* compute: forward+backward of the whole unsharded model in bf16 on one GPU without any
  communication, eager and under torch.compile (the graphed step runs Inductor's kernels);
* optimizer: torch.optim.AdamW(fused=True) over this rank's 1/world share of the fp32
  parameters, timed alone;
and the arithmetic floor, 6 x parameters x tokens per GPU / the device's dense bf16 rate.
"""
import json
import os
import pathlib
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fsdp_vs_dcplan as fvd  # noqa: E402

# Dense bf16 tensor rate, FLOP/s, by device name (NVIDIA's data sheets, no sparsity): the SXM parts
# (PCIe and NVL H100s are slower and not listed: no floor is printed for them).
PEAK_BF16 = {"H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "H200": 989e12}

# (category, test on the lower-cased kernel name), first match wins; Kineto's own memset and
# memcpy categories come before these.
CATEGORIES = [
    ("collectives", lambda n: "nccl" in n),
    ("optimizer", lambda n: "multi_tensor_apply" in n or "adam" in n),
    ("attention", lambda n: any(k in n for k in ("flash", "fmha", "attention", "sdpa"))),
    ("matmul", lambda n: any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk"))),
    ("memset and fills", lambda n: "fillfunctor" in n or "fill_kernel" in n),
    # Inductor names a kernel after the ops it fuses: a dtype conversion with nothing but data
    # movement beside it is a cast.
    ("casts", lambda n: n.startswith("triton") and ("to_copy" in n or "convert_element_type" in n) and
     _only_fused(n, ("to_copy", "convert_element_type", "clone", "cat", "copy", "view"))),
    # ATen's copy_ to a dtype: bfloat16_copy_kernel_cuda, or an elementwise kernel that loads or
    # stores with a cast; chunk_cat packing one dtype into another (the reduce buckets).
    ("casts", lambda n: any(k in n for k in ("bfloat16_copy_kernel", "float16_copy_kernel")) or
     ("copy_kernel" in n and "withcast" in n) or _chunk_cat_casts(n)),
    ("copies", lambda n: "copy_kernel" in n or "catarraybatchedcopy" in n or "memcpy" in n or "chunk_cat" in n or
     (n.startswith("triton") and _only_fused(n, ("clone", "cat", "copy", "slice_scatter", "view")))),
    ("pointwise and reductions", lambda n: n.startswith("triton") or "elementwise" in n or "reduce" in n),
]
ORDER = ["matmul", "attention", "pointwise and reductions", "other compute", "casts", "copies", "optimizer",
         "collectives", "memset and fills"]


def _only_fused(name: str, parts) -> bool:
    """Whether an Inductor kernel name (triton_<kind>_fused_<ops>_<n>) fuses only ops among parts."""
    if "_fused_" not in name:
        return False
    ops = name.split("_fused_", 1)[1].rstrip("0123456789").strip("_")
    for p in sorted(parts, key=len, reverse=True):
        ops = ops.replace(p, "")
    return ops.strip("_") == ""


def _chunk_cat_casts(name: str) -> bool:
    """chunk_cat_cuda_kernel<Out, In> with two different types."""
    if "chunk_cat" not in name or "<" not in name:
        return False
    types = [t.strip() for t in name.split("<", 1)[1].split(">", 1)[0].split(",")]
    return len(types) >= 2 and types[0].replace("c10::", "") != types[1].replace("c10::", "")


def category(name: str, kineto_cat: str) -> str:
    if kineto_cat == "gpu_memset":
        return "memset and fills"
    if kineto_cat == "gpu_memcpy":
        return "copies"
    n = name.lower()
    return next((c for c, test in CATEGORIES if test(n)), "other compute")


def union(iv):
    out = []
    for lo, hi in sorted(iv):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def length(iv) -> float:
    return sum(hi - lo for lo, hi in iv)


def overlap(x, y) -> float:
    i = j = 0
    out = 0.0
    while i < len(x) and j < len(y):
        out += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def device_kernels(run_steps, steps: int):
    """The GPU kernels, memsets and copies of `steps` steps (run_steps(steps) runs them) as
    (start us, end us, name, Kineto category)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(steps)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e["ts"], e["ts"] + e["dur"], e.get("name", ""), e.get("cat", "")) for e in events
            if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and e.get("dur", 0) > 0]


def breakdown(kernels, steps: int) -> dict:
    """Per step, in ms: each category's kernel time, the exposed collectives, busy, idle and the
    window from the first kernel's start to the last one's end; the top kernels by time."""
    by_cat, by_name, hiding = {}, {}, []
    for lo, hi, name, cat in kernels:
        c = category(name, cat)
        by_cat.setdefault(c, []).append((lo, hi))
        total, count, _ = by_name.get(name, (0.0, 0, c))
        by_name[name] = (total + hi - lo, count + 1, c)
        if cat == "kernel" and c != "collectives":  # what hides a collective: compute kernels, not the
            hiding.append((lo, hi))                  # copy engine's memcpy and memset
    ms = steps * 1e3
    cats = {c: length(union(iv)) / ms for c, iv in by_cat.items()}
    comm = union(by_cat.get("collectives", []))
    rest = union(hiding)
    busy = length(union([(lo, hi) for lo, hi, _, _ in kernels]))
    window = max(hi for _, hi, _, _ in kernels) - min(lo for lo, _, _, _ in kernels)
    top = sorted(((t / ms, n // steps, c, name) for name, (t, n, c) in by_name.items()), reverse=True)[:15]
    return {"categories_ms": cats, "exposed_collectives_ms": (length(comm) - overlap(comm, rest)) / ms,
            "busy_ms": busy / ms, "idle_ms": (window - busy) / ms, "window_ms": window / ms, "top": top}


class BreakdownBench(fvd.Bench):
    """The bench whose --profile-steps profile is this breakdown."""

    def profile(self, step, mode):
        kernels = device_kernels(lambda n: [step(i % len(self.batches)) for i in range(n)], self.args.profile_steps)
        return breakdown(kernels, self.args.profile_steps) if kernels else None

    def device_bounds(self) -> dict:
        """Rank 0: the compute bounds (eager and compiled) and the optimizer bound, as kernel time."""
        a, out = self.args, {}
        if self.rank == 0:
            steps = a.profile_steps
            for name, compiled in (("compute, eager", False), ("compute, torch.compile", True)):
                self.fresh()
                torch._dynamo.reset()
                model = self.model().to(torch.bfloat16)
                fwd = torch.compile(model) if compiled else model

                def fwd_bwd(n, fwd=fwd, model=model):
                    for i in range(n):
                        x, y = self.batches[i % len(self.batches)]
                        F.cross_entropy(fwd(x).float().flatten(0, 1), y.flatten()).backward()
                        for p in model.parameters():
                            p.grad = None

                out[name] = self.bound_of(fwd_bwd, steps)
                del model, fwd
            self.fresh()
            numels = [p.numel() for p in self.model().parameters()]
            shards = [torch.zeros(-(-n // self.world), device=self.device, requires_grad=True) for n in numels]
            for s in shards:
                s.grad = torch.randn_like(s) * 1e-3
            opt = torch.optim.AdamW(shards, lr=a.lr, weight_decay=0.01, fused=True)
            out["optimizer, fused AdamW over the shard"] = self.bound_of(lambda n: [opt.step() for _ in range(n)],
                                                                         steps)
            del opt, shards
        dist.barrier()
        return out

    def bound_of(self, run_steps, steps: int) -> dict:
        run_steps(self.args.warmup)  # compiles, autotunes, warms the allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_steps(steps)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
        kernels = device_kernels(run_steps, steps)
        return {"device_ms": length(union([(lo, hi) for lo, hi, _, _ in kernels])) / (steps * 1e3),
                "wall_ms": wall}


def report(meta: dict, step: dict, bounds: dict) -> None:
    b = step["breakdown"]
    if b is None:
        sys.exit("device_breakdown: the profile saw no kernel (is the profiler's CUDA activity available?)")
    print(f"\n{meta['label']}: dcplan-compiled-graphed{' with ' + meta['plan'] if meta['plan'] else ''}, "
          f"capturable {meta['adamw']} AdamW, "
          f"{meta['world']} x {meta['device']}, torch {meta['torch']}, {meta['params'] / 1e9:.3f}B parameters, "
          f"{meta['tokens']} tokens per GPU")
    print(f"losses: first {step['losses'][0]:.4f}, last {step['losses'][-1]:.4f}")
    print(f"step: {1e3 * step['step_s']:.2f} ms wall (mean of the timed steps, slowest rank), peak "
          f"{step['peak_bytes'] / 2**30:.2f} GiB (max over ranks); "
          f"device window {b['window_ms']:.2f} ms, busy {b['busy_ms']:.2f}, idle {b['idle_ms']:.2f} "
          f"(Kineto, {meta['profile_steps']} steps, rank 0)")
    print(f"  {'category':28s} {'ms/step':>8s} {'of window':>10s}")
    cats = b["categories_ms"]
    for c in ORDER + sorted(set(cats) - set(ORDER)):
        if c in cats:
            print(f"  {c:28s} {cats[c]:8.2f} {100 * cats[c] / b['window_ms']:9.1f}%")
    print(f"  {'collectives not overlapped':28s} {b['exposed_collectives_ms']:8.2f}")
    print(f"  {'idle':28s} {b['idle_ms']:8.2f} {100 * b['idle_ms'] / b['window_ms']:9.1f}%")
    print("top kernels (ms/step, launches/step, category):")
    for t, n, c, name in b["top"]:
        print(f"  {t:7.3f} {n:5d}  {c:26s} {name[:110]}")
    if not bounds:
        return
    print("device bounds (kernel time per step; wall time beside it):")
    for name, v in bounds.items():
        print(f"  {name:40s} {v['device_ms']:8.2f} ms device  ({v['wall_ms']:.2f} ms wall)")
    compiled = bounds.get("compute, torch.compile", {}).get("device_ms")
    opt = bounds.get("optimizer, fused AdamW over the shard", {}).get("device_ms")
    if compiled is not None and opt is not None:
        bound = compiled + opt
        print(f"  {'compiled compute + fused optimizer':40s} {bound:8.2f} ms; the graphed step is "
              f"{1e3 * step['step_s'] / bound:.2f}x that (target: within 1.15x)")
    if meta["floor_ms"] is not None:
        print(f"  arithmetic floor: 6 x {meta['params'] / 1e9:.3f}G x {meta['tokens']} / {meta['peak'] / 1e12:.0f} "
              f"TFLOP/s = {meta['floor_ms']:.2f} ms")


def main():
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    args = fvd.parse_args()
    args.profile_steps = args.profile_steps or 5
    if args.warmup < 3:
        sys.exit("device_breakdown: --warmup should be at least 3 (two warm-up calls, then the capture)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    bench = BreakdownBench(args)
    plan = args.compiled_plan.split(",")[0] if args.compiled_plan else None
    steps = {}  # the step with each AdamW implementation, in one process (the host varies between machines)
    # $ADAMW: which AdamW implementations to run (run_on_box.sh breakdown; default both).
    for adamw in os.environ.get("ADAMW", "foreach fused").split():
        args.adamw = adamw
        steps[adamw] = bench.dcplan(plan, compiled=True, graphed=True)
    bounds = bench.device_bounds()
    if bench.rank == 0:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        params = sum(p.numel() for p in bench.model().parameters())
        tokens = args.batch * args.seq
        meta = {"label": args.label or f"{args.batch}x{args.seq}", "plan": plan, "world": bench.world,
                "device": name, "torch": torch.__version__, "params": params, "tokens": tokens, "peak": peak,
                "floor_ms": 6 * params * tokens / peak * 1e3 if peak else None,
                "profile_steps": args.profile_steps}
        for adamw, step in steps.items():
            report({**meta, "adamw": adamw}, step, bounds if adamw == "fused" else {})
        if args.json:
            with open(args.json, "w") as f:
                runs = {a: {k: v for k, v in st.items() if k != "losses"} for a, st in steps.items()}
                json.dump({**meta, "steps": runs, "bounds": bounds}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
