"""The planner's memory model against the runtime's allocation log, on 2 Gloo ranks.

For each configuration of the example model (examples/train_llama.py) the run is recorded once,
then planned under a sweep of memory budgets around the default schedule's predicted peak, and
every plan is replayed with the replay log on. The CPU ranks count every byte of every live CPU
tensor (the counting allocator). Checked, per plan and rank, over the log's last complete
optimizer step (the peak of the per-op windows of the allocation log) and over the whole run
(the replay log's marks, as check_replay reads them):

* the measured peak stays within the budget and the predicted peak, each plus GLOO_TIMING (5%);
* it is at least 90% of the predicted peak: a sanity bound against over-counting (a ZeRO-2 run
  counted its parameters twice, 17%, before session 8).

Why 5% and not the planner's 0.5% reserve: op by op, the model still misses some memory of its
own (up to 2.3% at a release in the second micro-step of the bf16 configuration, the same in
every run), and the peak can land there. Before session 12 Gloo's worker thread also freed a
collective's scratch at a time of its own, and a plan's peak measured up to 2.0% over its
prediction in one CI run and 8.6% over its budget in another (a loaded machine). The transport
now waits for the worker to let go of a completed work, so the scratch is freed at the op the
model puts it at; test_a_loaded_machine_frees_scratch_where_the_model_does checks that, op by op,
with two busy processes beside the ranks. The 3% target of issue 14 and the budget without
tolerance are measured on a GPU (docs/benchmarks.md, "1 GPU, memory").
"""
import json
import os
import subprocess
import sys

import pytest
from mp_harness import busy_processes, dcplan_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama.py")
STEPS = 6
WORLD_SIZE = 2
GLOO_TIMING = 0.05
SANITY_SHARE = 0.90
# Op by op under load, ZeRO-2: after the transport's fix the most any op measured over its
# prediction was 408 bytes (0.004%) over 6 loaded replays; before it, 10% (a fused gather's
# scratch, 590 KB, still held at the next gather). 1% keeps the check clear of rounding. Beyond
# it, each op may hold the scratch of the collectives in flight during its window (held_in_windows):
# Gloo's worker allocates and frees a collective's scratch as it runs it, before the wait, and how
# far it got by an op is the scheduler's choice (a CI run measured one in-flight gather group,
# 196,608 bytes, at an op the model has it finished by).
LOADED_PER_OP = 0.01

pytestmark = pytest.mark.multiprocess

CONFIGS = {
    "zero3": ["--stage", "3"],
    "zero3-bf16-accum2": ["--stage", "3", "--param-dtype", "bfloat16", "--grad-accum", "2"],
    "zero2": ["--stage", "2"],
    "zero1-accum2": ["--stage", "1", "--grad-accum", "2"],
}


def train(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE), EXAMPLE,
            "--steps", str(STEPS), *args]


def last_run(events, graph):
    """The events of graph's one execution in the replay log's last complete step (as
    curve_comparison reads it)."""
    from dcplan._plan import executions

    execs = executions(events)
    last = sorted({ex["step"] for ex in execs})[-2]
    runs = [ex for ex in execs if ex["step"] == last and ex["graph"] == graph]
    assert len(runs) == 1, f"one execution of graph {graph} per step (no accumulation), got {len(runs)}"
    return runs[0]["events"]


def held_in_windows(spans):
    """position -> bytes of the spans [launched, waited, bytes] in flight during that op's measured
    window: a collective launched at a position goes out after that op's reading, and one waited
    at a position is still in that op's window until the wait returns, so it is in flight at q
    when launched <= q - 1 <= waited. Gloo's worker allocates and frees a collective's scratch as
    it runs it, before the wait; how far it got by an op is the scheduler's choice."""
    # A collective never waited would be allowed to the end, so there must be none.
    assert all(waited is not None for _, waited, _ in spans), spans
    return lambda q: sum(b for launched, waited, b in spans if launched <= q - 1 <= waited)


def gathers_in_flight(events):
    """held_in_windows of the forward's gather groups: their gathered bytes, until the first wait
    for a member."""
    groups = []  # [launch position, first wait of a member or None, bytes, members]
    for e in last_run(events, 0):
        if e["ev"] in ("prefetch", "gather") and e.get("bytes"):
            groups.append([e["pos"], None, e["bytes"], set(e.get("launched", e["ds_ids"]))])
        elif e["ev"] == "op" and e["op"] == "wait_allgather":
            for g in groups:
                if g[1] is None and e["ds_id"] in g[3]:
                    g[1] = e["pos"]
    return held_in_windows([g[:3] for g in groups])


def reductions_in_flight(events):
    """held_in_windows of the backward's reduce buckets: each one's reduce-scatter scratch (the
    bucket less the rank's own slice, as RuntimeMemory::reduceScatterScratch), until the next
    bucket's launch or end_backward, where the model frees it too."""
    buckets = []  # [launch position, next launch or None, scratch bytes]
    for e in last_run(events, 1):
        if e["ev"] == "flush" or (e["ev"] == "op" and e["op"] == "end_backward"):
            if buckets and buckets[-1][1] is None:
                buckets[-1][1] = e["pos"]
            if e["ev"] == "flush":
                buckets.append([e["pos"], None, e["bytes"] * (WORLD_SIZE - 1) // WORLD_SIZE])
    return held_in_windows(buckets)


def run(cmd, env=None, check=True):
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                         text=True, timeout=600)
    if check:
        assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def recorded(request, tmp_path_factory, dcplan_module):
    """(config args, trace path, the default schedule's predicted peak) for one configuration."""
    exe = dcplan_binary()
    d = tmp_path_factory.mktemp(request.param)
    trace = d / "trace.json"
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *train(*CONFIGS[request.param])])
    default = d / "default.json"
    run([exe, "plan", str(trace), "-o", str(default), "--strategy", "default"])
    peak = json.loads(default.read_text())["predicted"]["peak_memory_bytes"]
    return CONFIGS[request.param], trace, peak, d


def test_measured_memory_keeps_the_budget_and_the_prediction(recorded, dcplan_module):
    args, trace, default_peak, d = recorded
    exe = dcplan_binary()
    accepted, replayed = 0, set()
    for factor in (0.97, 1.0, 1.04, 1.1):  # rising: a schedule kept under a lower budget keeps a higher one
        budget = int(default_peak * factor)
        plan = d / f"plan-{factor}.json"
        res = run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", str(budget)], check=False)
        if res.returncode != 0:
            assert "below what any schedule needs" in res.stderr, res.stderr
            continue
        accepted += 1
        # The same schedule as a lower budget's (all but the options, the budget among them): its
        # replay would be that one again, already held to the lower budget.
        schedule = json.dumps({k: v for k, v in json.loads(plan.read_text()).items() if k != "options"},
                              sort_keys=True)
        if schedule in replayed:
            continue
        replayed.add(schedule)
        curve = d / f"plan-{factor}.curve.json"
        run([exe, "inspect", str(plan), "--trace", str(trace), "--memory-curve", str(curve)])
        log = d / f"replay-{factor}.{{rank}}.jsonl"
        run(train(*args), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)})
        simulated = json.loads(curve.read_text())
        for rank in range(2):
            events = dcplan_module.read_replay_log(str(log).replace("{rank}", str(rank)))
            assert dcplan_module.replay_differences(str(plan), events) == []
            cmp = dcplan_module.curve_comparison(simulated, events)
            where = f"{plan.name}, rank {rank}"
            assert len(cmp["ops"]) > 0, where
            measured, predicted = cmp["measured_peak"], cmp["predicted_peak"]
            worst = sorted(cmp["ops"], key=lambda r: r[4] - r[5])[:3]
            detail = f"{where}: predicted peak {predicted}, measured {measured}; ops most above: {worst}"
            assert measured <= budget * (1 + GLOO_TIMING), f"over the budget {budget}: {detail}"
            # The whole run too (every step's peak, as check_replay reads it from the marks).
            run_peak = max(e["peak_bytes"] for e in events if e["ev"] == "mark")
            assert run_peak <= budget * (1 + GLOO_TIMING), f"{where}: the run peaked at {run_peak}, budget {budget}"
            assert measured <= predicted * (1 + GLOO_TIMING), detail
            assert measured >= SANITY_SHARE * predicted, detail
    assert accepted >= 2, "the sweep should leave at least two budgets the planner accepts"


@pytest.mark.parametrize("recorded", ["zero2"], indirect=True)
def test_a_loaded_machine_frees_scratch_where_the_model_does(recorded, dcplan_module):
    """Every op of a prefetching plan, replayed beside two busy processes, within LOADED_PER_OP
    of the simulated memory at that op, plus the Gloo scratch of the collectives in flight during
    it (held_in_windows): a gather's scratch is freed when its wait returns, not when Gloo's worker
    thread next runs (without that, forward gathers measured 10% over; with the fix disabled, this
    check failed in 2 of 3 loaded replays, by up to 590,592 bytes against 262,656 in flight, and
    in 3 of 10 in session 14, always in the forward). The backward holds the same effect for
    reductions: in 1 of 100 loaded replays of a rank, 196,864 bytes over at the 3 reduce_grad ops
    before the next bucket's launch, inside the window of a bucket of 393,216 bytes whose scratch is
    196,608, as when the worker runs that reduction late (the CI run of session 12 that had the
    backward left out measured the same, 192 KiB for 3 reduce_grad ops; docs/planning.md)."""
    args, trace, default_peak, d = recorded
    exe = dcplan_binary()
    for factor in (1.1, 1.15):
        plan = d / f"loaded-{factor}.json"
        run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", str(int(default_peak * factor))])
        curve = d / f"loaded-{factor}.curve.json"
        run([exe, "inspect", str(plan), "--trace", str(trace), "--memory-curve", str(curve)])
        log = d / f"loaded-{factor}.{{rank}}.jsonl"
        with busy_processes(2):
            res = run(train(*args), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)})
        # The transport waited for Gloo's worker and did not give up (it warns when it does).
        assert "still referenced elsewhere" not in res.stderr, res.stderr[-2000:]
        simulated = json.loads(curve.read_text())
        for rank in range(2):
            events = dcplan_module.read_replay_log(str(log).replace("{rank}", str(rank)))
            cmp = dcplan_module.curve_comparison(simulated, events)
            assert len(cmp["ops"]) > 0
            for graph, held in ((0, gathers_in_flight(events)), (1, reductions_in_flight(events))):
                ops = [r for r in cmp["ops"] if r[0] == graph]  # (graph, micro, position, op, predicted, measured)
                assert ops, f"{plan.name}, rank {rank}: no op of graph {graph} compared"
                over = [(*r, held(r[2])) for r in ops if r[5] > r[4] * (1 + LOADED_PER_OP) + held(r[2])]
                assert over == [], f"{plan.name}, rank {rank}: ops above the simulated memory and the collectives " \
                                   f"in flight (graph, micro, position, op, predicted, measured, in flight): {over[:5]}"
