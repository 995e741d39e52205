"""Multi-rank worker of the Python tests: one process per Gloo rank runs every case once.

Each case trains a tiny transformer with dcplan.shard() for a few AdamW steps;
rank 0 also trains the same model in plain single-process PyTorch on the whole
global batch. Results (losses, full parameters, op-level checks) are saved per
rank and compared by the tests in the parent process.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 10
SEQ = 6
BATCH = 12  # global batch per micro-step; divisible by 2, 3 and 4 ranks (tests/gpu at DCPLAN_TEST_GPUS=4)
LR = 1e-3
MAX_NORM = 0.3  # the clip variant: below the gradients' norm at every step (0.45-0.55 at BATCH 12), so every step clips
LOG_STEP = 2  # the optimizer step whose dc ops are recorded
BUCKET_BYTES = 1024  # small, so that backward flushes several buckets (double buffering)
# Where models and data live: the CPU here; tests/gpu sets each rank's GPU (NCCL path).
DEVICE = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    stage: int
    variant: str = "base"  # base, accum, tied, twice, frozen, odd, bf16, subgroup


def all_cases() -> List[Case]:
    variants = ["base", "accum", "tied", "twice", "frozen", "odd", "bf16"]
    cases = [Case(f"zero{s}-{v}", s, v) for s in (1, 2, 3) for v in variants]
    cases += [Case(f"zero{s}-clip", s, "clip") for s in (1, 3)]  # dcplan.clip_grad_norm_ each step
    return cases + [Case("zero3-subgroup", 3, "subgroup")]  # a group made by dist.new_group


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        # No bias: a key bias has a gradient of exactly zero in exact arithmetic
        # (softmax ignores a per-row constant), so AdamW would amplify rounding noise.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, ff: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Embedding, one attention block, MLP, norms; sizes mostly not divisible by 2 or 3."""

    def __init__(self, vocab=37, d=10, ff=23, heads=2, tied=False, twice=False, gate=False):
        super().__init__()
        self.twice = twice
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.1)
        self.block = Block(d, ff, heads)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.gate = nn.Linear(d, 1) if gate else None  # weight [1, d] and a bias of 1 element: fewer elements than ranks

    def forward(self, idx):
        x = self.embed(idx) + self.pos
        x = self.block(x)
        if self.twice:
            x = self.block(x)
        h = self.ln_f(x)
        if self.gate is not None:
            h = h + self.gate(h)  # broadcast over d; added to the logits it would cancel in the softmax
        return self.head(h)


def make_model(case: Case) -> nn.Module:
    torch.manual_seed(1234)
    if case.variant == "odd":
        model = TinyTransformer(vocab=11, d=6, ff=13, heads=3, gate=True)
    else:
        model = TinyTransformer(tied=case.variant == "tied", twice=case.variant == "twice")
    if case.variant == "frozen":
        model.pos.requires_grad_(False)
        model.block.ln1.weight.requires_grad_(False)
    return model.to(DEVICE)


def micro_steps(case: Case) -> int:
    return 4 if case.variant == "accum" else 1


def batches(case: Case, vocab: int):
    """Per optimizer step, a list of micro-batches (inputs, targets) of the global batch."""
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(STEPS):
        step = []
        for _ in range(micro_steps(case)):
            idx = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            tgt = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            step.append((idx, tgt))
        out.append(step)
    return out


def loss_fn(model, idx, tgt):
    logits = model(idx.to(DEVICE))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1).to(DEVICE))


def train_reference(case: Case) -> Dict:
    model = make_model(case)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    n = micro_steps(case)
    losses, norms = [], []
    for step in batches(case, model.embed.num_embeddings):
        total = 0.0
        for idx, tgt in step:
            loss = loss_fn(model, idx, tgt) / n
            loss.backward()
            total += loss.item()
        if case.variant == "clip":
            norms.append(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "norms": norms}


def train_sharded(case: Case, rank: int, ws: int) -> Dict:
    import dcplan

    model = make_model(case)
    # bf16: gather and compute in bf16, reduce gradients in fp32, fp32 master shards.
    param_dtype = torch.bfloat16 if case.variant == "bf16" else None
    reduce_dtype = torch.float32 if case.variant == "bf16" else None
    group = dist.new_group(list(range(ws))) if case.variant == "subgroup" else None
    dcplan.shard(model, stage=case.stage, process_group=group, param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype, reduce_bucket_bytes=BUCKET_BYTES)
    shards = list(model.parameters())
    opt = torch.optim.AdamW([p for p in shards if p.requires_grad], lr=LR, weight_decay=0.01)
    n = micro_steps(case)
    if BATCH % ws:
        raise ValueError(f"dist_cases.BATCH: {BATCH} rows do not split evenly over {ws} ranks")
    per = BATCH // ws
    losses, norms = [], []
    gathered_after_forward = []
    op_log = None
    for s, step in enumerate(batches(case, model.embed.num_embeddings)):
        if s == LOG_STEP:
            dcplan._C.start_op_log()
        total = torch.zeros((), device=DEVICE)
        for k, (idx, tgt) in enumerate(step):
            model.set_requires_gradient_sync(k == n - 1)
            mine = slice(rank * per, (rank + 1) * per)
            loss = loss_fn(model, idx[mine], tgt[mine]) / n
            gathered_after_forward.append(len(dcplan._C.gathered_param_ids()))
            loss.backward()
            total += loss.detach()
        if case.variant == "clip":
            norms.append(dcplan.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        if s == LOG_STEP:
            op_log = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    full = dcplan.full_parameters(model)
    state = model._dcplan
    elem = torch.tensor([], dtype=param_dtype or torch.float32).element_size()
    return {
        "losses": losses,
        "params": full,
        "shard_shapes": [tuple(p.detach().shape) for p in shards],  # the shard; p.shape is the original
        "num_params": len(model._dcplan.infos),
        "gathered_after_forward": gathered_after_forward,
        "op_log": op_log,
        "norms": norms,
        "graphs": (state.fwd_graph, state.bwd_graph),
        "trainable_ids": sorted(i.ds_id for i in state.infos if i.trainable),
        "frozen_ids": sorted(i.ds_id for i in state.infos if not i.trainable),
        "all_gather_bytes": sum(ws * i.shard.detach().numel() * elem for i in state.infos),
        "trainable_gather_bytes": sum(ws * i.shard.detach().numel() * elem for i in state.infos if i.trainable),
    }


def run_op_checks(rank: int, ws: int) -> Dict:
    """Direct op calls with rank-dependent data; returns what each op produced."""
    import dcplan

    C = dcplan._C
    C.init(dist.group.WORLD.group_name, reduce_bucket_bytes=64)
    out: Dict = {}
    shapes = {0: [5], 1: [3, 3], 2: [1], 3: [2, 7]}
    shards, grads = {}, {}
    for i, shape in shapes.items():
        numel = math.prod(shape)
        s = -(-numel // ws)
        full = torch.arange(numel, dtype=torch.float32) + 100 * i
        shard = torch.zeros(s)
        lo, hi = min(rank * s, numel), min(rank * s + s, numel)
        shard[: hi - lo] = full[lo:hi]
        shards[i], grads[i] = shard, torch.zeros(s)
        C.register_param(i, shape, shard, grads[i], False)
    C.register_graph_z3(0, [0, 1, 2, 3])
    C.register_graph_z1(1, [0, 1, 2, 3])
    scratch_shape = [SCRATCH_ROWS, 256]
    scratch_grad = torch.zeros(-(-math.prod(scratch_shape) // ws))
    scratch_shard = torch.full_like(scratch_grad, float(rank))
    C.register_param(SCRATCH_ID, scratch_shape, scratch_shard, scratch_grad, False)
    C.register_graph_z3(SCRATCH_GRAPH, [SCRATCH_ID])
    ops = torch.ops.dc
    out["gathers_beyond_copies"] = gathers_beyond_copies(shards, scratch_shard)
    g = ops.wait_allgather(ops.allgather_param(shards[1], 0, 1), 0, 1)
    out["allgather"] = g.clone()
    out["allgather_bf16"] = ops.wait_allgather(ops.allgather_param(shards[3], 0, 3, torch.bfloat16), 0, 3).clone()
    ops.release_param(torch.empty(0), 0, 1, 2)
    out["held_after_1_of_2"] = C.gathered_param_ids()
    ops.release_param(torch.empty(0), 0, 1, 2)
    ops.release_param(torch.empty(0), 0, 3, 1)
    out["held_after_2_of_2"] = C.gathered_param_ids()
    ops.prefetch_params_fused(0, [shards[0], shards[2], shards[3]], [0, 2, 3], [torch.float32] * 3)
    out["held_after_prefetch"] = C.gathered_param_ids()
    out["fused"] = [ops.wait_allgather(ops.allgather_param(shards[i], 0, i), 0, i).clone() for i in (0, 2, 3)]
    C.clear_all_gathered_params()
    # One call of two dtypes: a buffer (on Gloo, a set of broadcasts) for each.
    ops.prefetch_params_fused(0, [shards[0], shards[3]], [0, 3], [torch.float32, torch.bfloat16])
    out["fused_two_dtypes"] = [ops.wait_allgather(ops.allgather_param(shards[0], 0, 0), 0, 0).clone(),
                               ops.wait_allgather(ops.allgather_param(shards[3], 0, 3, torch.bfloat16), 0, 3).clone()]
    C.clear_all_gathered_params()
    out["held_after_clear"] = C.gathered_param_ids()
    # ZeRO-3 reduce: grad of rank r is (r+1) * ones; the mean lands in each rank's slice.
    C.start_backward(True, True)
    for i, shape in shapes.items():
        ops.reduce_grad(torch.full(shape, float(rank + 1)) * (i + 1), 0, i)
    ops.end_backward(0)
    out["z3_grads"] = {i: grads[i].clone() for i in shapes}
    out["z3_left_allocated"] = reductions_left_allocated(torch.full(scratch_shape, float(rank + 1)),
                                                         LOAD_PROCESSES if rank == 0 else 0)
    # ZeRO-1: two micro-steps, reduced only at the boundary, accumulating.
    C.start_backward(True, False)
    for i, shape in shapes.items():
        ops.reduce_grad(torch.full(shape, float(rank + 1)), 1, i)
    ops.end_backward(1)
    out["z1_before_boundary"] = {i: grads[i].clone() for i in shapes}
    C.start_backward(True, True)
    for i, shape in shapes.items():
        ops.reduce_grad(torch.full(shape, float(rank + 1)), 1, i)
    ops.end_backward(1)
    out["z1_grads"] = {i: grads[i].clone() for i in shapes}
    x = torch.full((4,), float(rank + 1))
    out["inference_all_reduce"] = ops.inference_all_reduce(x)
    out["inference_all_reduce_input"] = x.clone()
    y = torch.full((3, 2), float(rank + 1)).t()  # not contiguous
    ops.inference_all_reduce_(y)
    out["inference_all_reduce_"] = y.clone()
    C.cleanup()
    return out


# The op checks' parameter whose ZeRO-3 reductions are checked for what they leave allocated.
SCRATCH_ID, SCRATCH_GRAPH, SCRATCH_ROWS = 4, 2, 64
LOAD_ROUNDS, LOAD_PROCESSES = 100, 2
GATHER_ROUNDS = 5


def gathers_beyond_copies(shards: Dict[int, torch.Tensor], scratch_shard: torch.Tensor) -> Dict[str, List[int]]:
    """Bytes of CPU tensors each of GATHER_ROUNDS gathers held at their peak, from the issue to the
    wait, beyond the gathered copies they left (counted by the replay log's allocator), with what
    the planner's memory model says of them (RuntimeMemory::gatherScratchIssued, UntilWait): a
    single gather nothing (fp32) or its shard cast to bf16; a fused call its [world, total] buffer,
    the gathered size of its members. Gloo's own allgather had its worker thread allocate a flat
    output as large as the gathered one while it ran: there or not at an op as the scheduler ran it."""
    import dcplan

    C, ops = dcplan._C, torch.ops.dc
    probe = C.run_peak_probe("cpu")

    def beyond(gather, release) -> int:
        probe.peak()
        before = probe.in_use()
        gather()
        copies = probe.in_use() - before
        peak = probe.peak() - before
        release()
        return peak - copies

    def single(dtype):
        def gather():
            return ops.wait_allgather(ops.allgather_param(scratch_shard, SCRATCH_GRAPH, SCRATCH_ID, dtype),
                                      SCRATCH_GRAPH, SCRATCH_ID)
        return gather

    def fused():
        ops.prefetch_params_fused(0, [shards[0], shards[3]], [0, 3], [torch.float32] * 2)
        for i in (0, 3):
            ops.wait_allgather(ops.allgather_param(shards[i], 0, i), 0, i)

    def release(graph, ids):
        return lambda: [ops.release_param(torch.empty(0), graph, i, 1) for i in ids]

    return {"single": [beyond(single(torch.float32), release(SCRATCH_GRAPH, [SCRATCH_ID])) for _ in range(GATHER_ROUNDS)],
            "single_bf16": [beyond(single(torch.bfloat16), release(SCRATCH_GRAPH, [SCRATCH_ID]))
                            for _ in range(GATHER_ROUNDS)],
            "fused": [beyond(fused, release(0, [0, 3])) for _ in range(GATHER_ROUNDS)],
            "gathered": {dtype: gathered(single(dtype), release(SCRATCH_GRAPH, [SCRATCH_ID]))
                         for dtype in (torch.float32, torch.bfloat16)}}


def gathered(gather, release) -> torch.Tensor:
    """What a gather made (rank r's part holds r), flat, in fp32; outside any measurement."""
    g = gather().detach().reshape(-1).float().clone()
    release()
    return g


def reductions_left_allocated(grad: torch.Tensor, spinning: int) -> List[int]:
    """Bytes of CPU tensors each of LOAD_ROUNDS ZeRO-3 reductions of grad (one bucket each) left
    allocated once end_backward returned, counted by the replay log's allocator, on a machine this
    rank loads with `spinning` busy processes (rank 0 starts them: the machine's, not the rank's).
    The planner's memory model frees a reduce-scatter's scratch by then: Gloo's own reduce_scatter
    returned before its worker threads let go of its copies of the rows, which were freed whenever
    a worker next ran (a 2-rank replay 1.4 MiB over its prediction)."""
    import dcplan
    from mp_harness import busy_processes

    C, ops = dcplan._C, torch.ops.dc
    probe = C.run_peak_probe("cpu")
    left = []
    with busy_processes(spinning):
        for _ in range(LOAD_ROUNDS):
            before = probe.in_use()
            C.start_backward(True, True)
            ops.reduce_grad(grad, SCRATCH_GRAPH, SCRATCH_ID)
            ops.end_backward(SCRATCH_GRAPH)
            left.append(probe.in_use() - before)
    return left


def run_cases(rank: int, ws: int, case_names: Optional[List[str]], results: Dict, convert=lambda v: v) -> None:
    """Every selected case: the sharded run on each rank, the reference on rank 0 (convert: e.g.
    to CPU tensors), into results[case.name]; an error is recorded, then raised (the other
    ranks would be out of step from there)."""
    import dcplan

    for case in all_cases():
        if case_names is not None and case.name not in case_names:
            continue
        try:
            res = {"value": convert(train_sharded(case, rank, ws))}
            if rank == 0:
                res["reference"] = convert(train_reference(case))
            results[case.name] = res
        except Exception:
            results[case.name] = {"error": traceback.format_exc()}
            raise
        finally:
            dcplan.shutdown()


def worker(rank: int, ws: int, init_file: str, out_dir: str, case_names: Optional[List[str]]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws,
        timeout=datetime.timedelta(seconds=60),
    )
    import dcplan

    results: Dict[str, Dict] = {}
    try:
        try:
            results["ops"] = {"value": run_op_checks(rank, ws)}
        except Exception:
            results["ops"] = {"error": traceback.format_exc()}
            raise
        run_cases(rank, ws, case_names, results)
    except Exception:
        pass
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
