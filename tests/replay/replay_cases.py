"""Multi-rank worker of the replay tests: one process per Gloo rank runs every case once.

Per stage, a run without a plan gives the reference numbers and the op sequence
(from the runtime's op log, independent of the plan cursor); plans are built
from that sequence the way the planner writes them; each plan trains the same
model again with a replay log. Then refusals of bad plans and departures from
a plan. Results are saved per rank and checked by test_replay.py.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import traceback
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import dist_cases  # noqa: E402  (the tiny transformer of the runtime tests)

STEPS = 4
MICRO = 2  # micro-steps per optimizer step: ZeRO-1 defers, persistence counts per step
PLAN_KINDS = ["prefetch", "distance0", "all_persistent", "single_bucket"]
DEPART_STEP = 2  # the optimizer step whose forward calls the block twice


class Switchable(dist_cases.TinyTransformer):
    """The tiny transformer whose forward can call its block twice or skip it (a changed forward)."""

    def __init__(self):
        super().__init__()
        self.mode = "normal"
        self.held_in_backward = []  # per backward: the ds_ids held when its gradient reaches the input

    def forward(self, idx):
        x = self.embed(idx) + self.pos
        if x.requires_grad:
            x.register_hook(self._note_held)  # runs after every other module's backward
        if self.mode != "skip":
            x = self.block(x)
        if self.mode == "twice":
            x = self.block(x)
        return self.head(self.ln_f(x))

    def _note_held(self, grad):
        import dcplan

        self.held_in_backward.append(sorted(dcplan._C.gathered_param_ids()))


def make_model() -> Switchable:
    torch.manual_seed(1234)
    return Switchable().to(dist_cases.DEVICE)


def batches():
    g = torch.Generator().manual_seed(7)
    vocab = 37
    return [[(torch.randint(0, vocab, (dist_cases.BATCH, dist_cases.SEQ), generator=g),
              torch.randint(0, vocab, (dist_cases.BATCH, dist_cases.SEQ), generator=g)) for _ in range(MICRO)]
            for _ in range(STEPS)]


def train(stage: int, rank: int, ws: int, plan: Optional[str] = None, on_mismatch: str = "error",
          log: Optional[str] = None, depart: Optional[Tuple[int, str]] = None, op_log_step: Optional[int] = None,
          bf16: bool = False):
    """Trains STEPS optimizer steps; depart=(step, mode) switches the forward from that step on."""
    import dcplan

    model = make_model()
    # bf16: gathers (and planned prefetches) in bf16, gradients reduced in fp32.
    dtypes = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    dcplan.shard(model, stage=stage, plan=plan, on_mismatch=on_mismatch, **dtypes)
    if log is not None:
        dcplan.replay_log(log)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    per = dist_cases.BATCH // ws
    losses, op_log = [], None
    for s, step in enumerate(batches()):
        if depart is not None and s == depart[0]:
            model.mode = depart[1]
        if s == op_log_step:
            dcplan._C.start_op_log()
        total = torch.zeros((), device=dist_cases.DEVICE)
        for k, (idx, tgt) in enumerate(step):
            model.set_requires_gradient_sync(k == MICRO - 1)
            mine = slice(rank * per, (rank + 1) * per)
            loss = dist_cases.loss_fn(model, idx[mine], tgt[mine]) / MICRO
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        if s == op_log_step:
            op_log = dcplan._C.take_op_log()
            dcplan._C.stop_op_log()
        dist.all_reduce(total)
        losses.append(total.item() / ws)
    state = model._dcplan
    out = {
        "losses": losses,
        "params": {k: v.cpu() for k, v in dcplan.full_parameters(model).items()},
        "fwd": state.fwd_graph,
        "bwd": state.bwd_graph,
        "infos": [(i.ds_id, i.name, list(i.shape), i.shard.detach().numel(), i.trainable) for i in state.infos],
        "signature": dcplan._plan.signature(state.infos, ws),
        "op_log": op_log,
        "held_in_backward": model.held_in_backward,
    }
    if log is not None:
        dcplan._C.flush_replay_log()
    return out


def executions(op_log) -> List[Tuple[int, List[Tuple[str, int]]]]:
    """The op log cut into graph executions: consecutive ops of one graph id."""
    out: List[Tuple[int, List[Tuple[str, int]]]] = []
    for op, g, i, _, _ in op_log:
        if not out or out[-1][0] != g:
            out.append((g, []))
        out[-1][1].append((op, i))
    return out


def build_plan(kind: str, stage: int, ws: int, base: Dict) -> Dict:
    """A plan in dcplan.plan/v1 for the baseline's op sequence, as the planner would write one."""
    ex = executions(base["op_log"])
    fwd_ops = next(ops for g, ops in ex if g == base["fwd"])
    bwd_ops = next(ops for g, ops in ex if g == base["bwd"])
    ids = [i[0] for i in base["infos"]]
    shard_numel = {i[0]: i[3] for i in base["infos"]}

    def groups(ops):
        gathers = [(q, i) for q, (op, i) in enumerate(ops) if op == "allgather_param"]
        if kind == "distance0":
            return [{"position": q, "ds_ids": [i]} for q, i in gathers]
        out = []
        for k in range(0, len(gathers), 2):  # two gathers a group, issued one gather ahead
            members = list(dict.fromkeys(i for _, i in gathers[k:k + 2]))
            out.append({"position": gathers[k - 1][0] if k else 0, "ds_ids": members})
        return out

    ready = list(dict.fromkeys(i for op, i in bwd_ops if op == "reduce_grad"))
    chunks = [ready] if kind == "single_bucket" else [ready[k:k + 3] for k in range(0, len(ready), 3)]
    buckets = [{"ds_ids": c, "bytes": sum(ws * shard_numel[i] * 4 for i in c), "dtype": "float32"} for c in chunks]
    if stage < 3 or kind == "all_persistent":
        persistent = sorted(ids)
    else:
        persistent = sorted(ids)[::3]
    # ZeRO-3: each persistent copy ends at its last backward release before a step (persistent_ends).
    last_release = {i: q for q, (op, i) in enumerate(bwd_ops) if op == "release_param" and i in persistent}
    ends = [{"position": q, "ds_id": i} for i, q in sorted(last_release.items(), key=lambda item: item[1])]
    pred = {"step_us": 1.0, "exposed_comm_us": 0.0, "peak_memory_bytes": 1}
    return {
        "schema": "dcplan.plan/v1",
        "created_by": "tests/replay",
        "source": {"trace": "baseline", "trace_digest": "fnv1a64:0000000000000000",
                   "param_signature": base["signature"], "world_size": ws, "stage": stage},
        "options": {"strategy": "optimized", "grad_accum_steps": MICRO},
        "persistent": persistent,
        "graphs": [
            {"id": base["fwd"], "kind": "forward", "prefetch": groups(fwd_ops), "buckets": []},
            {"id": base["bwd"], "kind": "backward", "prefetch": groups(bwd_ops), "buckets": buckets,
             **({"persistent_ends": ends} if stage == 3 and ends else {})},
        ],
        "predicted": pred,
        "predicted_default": pred,
    }


def write_plan(plan: Dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump(plan, f, indent=2)
        f.write("\n")
    return path


def expect_error(fn, exc_types=(ValueError, RuntimeError)) -> str:
    try:
        fn()
    except exc_types as e:
        return str(e)
    return "<no error>"


def run_all(rank: int, ws: int, tmp: str, results: Dict) -> None:
    import dcplan

    tmp = os.path.join(tmp, f"rank{rank}")  # every rank writes its own plan files
    os.makedirs(tmp, exist_ok=True)

    def case(name, fn):
        if os.environ.get("DCPLAN_TEST_VERBOSE"):
            print(f"rank {rank}: {name}", flush=True)
        try:
            results[name] = {"value": fn()}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            raise
        finally:
            dcplan.shutdown()

    for stage in (1, 2, 3):
        base = {}
        case(f"zero{stage}-baseline", lambda: base.update(train(stage, rank, ws, op_log_step=1)) or base)
        for kind in PLAN_KINDS:
            plan = build_plan(kind, stage, ws, base)
            path = write_plan(plan, os.path.join(tmp, f"zero{stage}-{kind}.plan.json"))
            log = os.path.join(tmp, f"zero{stage}-{kind}.log.{{rank}}")

            def run(path=path, log=log, plan=plan):
                out = train(stage, rank, ws, plan=path, log=log)
                out["plan"] = plan
                out["log"] = dcplan.read_replay_log(log.replace("{rank}", str(rank)))
                return out

            case(f"zero{stage}-{kind}", run)

    # Mixed precision: the planned prefetches gather in the gathers' dtype.
    base16 = {}
    case("zero3-bf16-baseline", lambda: base16.update(train(3, rank, ws, op_log_step=1, bf16=True)) or base16)
    plan16 = build_plan("prefetch", 3, ws, base16)
    path16 = write_plan(plan16, os.path.join(tmp, "zero3-bf16.plan.json"))
    log16 = os.path.join(tmp, "zero3-bf16.log.{rank}")

    def run16():
        out = train(3, rank, ws, plan=path16, log=log16, bf16=True)
        out["plan"] = plan16
        out["log"] = dcplan.read_replay_log(log16.replace("{rank}", str(rank)))
        return out

    case("zero3-bf16-prefetch", run16)

    # Refusals, all at shard() time (stage 3 baseline plan as the template).
    base3 = results["zero3-baseline"]["value"]
    good = build_plan("prefetch", 3, ws, base3)

    def refusals():
        out = {}
        variants = {}
        p = copy.deepcopy(good)
        p["source"]["world_size"] = ws + 1
        variants["world_size"] = p
        p = copy.deepcopy(good)
        p["source"]["param_signature"] = "fnv1a64:0123456789abcdef"
        variants["model"] = p
        p = copy.deepcopy(good)
        p["source"]["stage"] = 2
        variants["stage"] = p
        p = copy.deepcopy(good)
        for b in p["graphs"][1]["buckets"]:
            b["dtype"] = "bfloat16"
        variants["dtype"] = p
        p = copy.deepcopy(good)
        p["graphs"][0]["kind"] = "backward"
        variants["graph_kind"] = p
        for name, plan in variants.items():
            path = write_plan(plan, os.path.join(tmp, f"refuse-{name}.plan.json"))
            out[name] = (path, expect_error(lambda: dcplan.shard(make_model(), stage=3, plan=path)))
            dcplan.shutdown()
        # Master shards kept on the host, for a compiled replay (the planner makes none: a hand-made plan).
        p = copy.deepcopy(good)
        p["source"]["replay"] = "compiled"
        p["offload"] = {"optimizer_state": [{"ds_ids": [0], "bytes": 8, "master_bytes": 4}]}
        path = write_plan(p, os.path.join(tmp, "refuse-master-compiled.plan.json"))
        out["master_compiled"] = (path, expect_error(
            lambda: dcplan.shard(make_model(), stage=3, plan=path, compile=True)))
        dcplan.shutdown()
        path = os.path.join(tmp, "refuse-corrupt.plan.json")
        with open(path, "w") as f:
            f.write(json.dumps(good)[:-40])
        out["corrupt"] = (path, expect_error(lambda: dcplan.shard(make_model(), stage=3, plan=path)))
        dcplan.shutdown()
        # Another model: a second layer norm renamed and resized changes names and shapes.
        other = make_model()
        other.ln_f = torch.nn.LayerNorm(11, device=dist_cases.DEVICE)
        other.head = torch.nn.Linear(11, 37, bias=False, device=dist_cases.DEVICE)
        path = write_plan(good, os.path.join(tmp, "refuse-other.plan.json"))
        out["other_model"] = (path, expect_error(lambda: dcplan.shard(other, stage=3, plan=path)))
        dcplan.shutdown()
        # Ranks that read different bytes (the file changed on disk between their loads): refused on every rank.
        path = os.path.join(tmp, f"differs-rank{rank}.plan.json")
        with open(path, "w") as f:
            json.dump(good, f, indent=rank + 1)
        out["differs"] = expect_error(lambda: dcplan.shard(make_model(), stage=3, plan=path))
        dcplan.shutdown()
        # DCPLAN_PLAN is used when no argument is given; the argument wins.
        os.environ["DCPLAN_PLAN"] = out["world_size"][0]
        out["env"] = expect_error(lambda: dcplan.shard(make_model(), stage=3))
        dcplan.shutdown()
        good_path = write_plan(good, os.path.join(tmp, "good.plan.json"))
        dcplan.shard(make_model(), stage=3, plan=good_path)
        out["arg_wins"] = dcplan._C.plan_active()
        dcplan.shutdown()
        del os.environ["DCPLAN_PLAN"]
        return out

    case("refusals", refusals)

    # Departures: the forward calls its block twice from DEPART_STEP on.
    for stage in (1, 3):
        base = results[f"zero{stage}-baseline"]["value"]
        plan = build_plan("prefetch", stage, ws, base)
        path = write_plan(plan, os.path.join(tmp, f"depart{stage}.plan.json"))
        ref = {}
        case(f"depart{stage}-reference",
             lambda: ref.update(train(stage, rank, ws, depart=(DEPART_STEP, "twice"), op_log_step=DEPART_STEP)) or ref)

        def error_mode(path=path):
            msg = expect_error(lambda: train(stage, rank, ws, plan=path, depart=(DEPART_STEP, "twice")),
                               (RuntimeError,))
            return {"message": msg}

        case(f"depart{stage}-error", error_mode)

        def fallback(path=path):
            import warnings

            log = os.path.join(tmp, f"depart{stage}-fallback.log.{{rank}}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = train(stage, rank, ws, plan=path, on_mismatch="fallback", log=log,
                            depart=(DEPART_STEP, "twice"))
            out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
            out["log"] = dcplan.read_replay_log(log.replace("{rank}", str(rank)))
            return out

        case(f"depart{stage}-fallback", fallback)

    # A forward that leaves out the block from the first step on (no execution to compare with yet).
    base = results["zero3-baseline"]["value"]
    path = write_plan(build_plan("prefetch", 3, ws, base), os.path.join(tmp, "skip.plan.json"))
    case("skip-error", lambda: {"message": expect_error(
        lambda: train(3, rank, ws, plan=path, depart=(0, "skip")), (RuntimeError,))})


def worker(rank: int, ws: int, init_file: str, out_dir: str, backend: str = "gloo") -> None:
    """One rank: backend "gloo" on CPU, or "nccl" with the model on GPU rank (dcplan's NCCL transport)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if os.environ.get("DCPLAN_TEST_HANG_SECONDS"):  # debugging a hang: every rank's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["DCPLAN_TEST_HANG_SECONDS"]), exit=True)
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)  # a crash names its C++ frames
    kw = {}
    if backend == "nccl":
        dist_cases.DEVICE = torch.device("cuda", rank)  # the model and data of every case
        torch.cuda.set_device(dist_cases.DEVICE)
        kw["device_id"] = dist_cases.DEVICE
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60), **kw)
    import dcplan  # noqa: F401

    results: Dict[str, Dict] = {}
    try:
        run_all(rank, ws, out_dir, results)
    except Exception:
        pass  # recorded in results; the other ranks would be out of step from here
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
