"""The planner's memory model against the runtime's allocation log, on 2 Gloo ranks.

For each configuration of the example model (examples/train_llama.py) the run is recorded once,
then planned under a sweep of memory budgets around the default schedule's predicted peak, and
every plan is replayed with the replay log on. The CPU ranks count every byte of every live CPU
tensor (the counting allocator), so the comparison is exact up to what the transports do on
their own threads. Checked, per plan and rank, over the log's last complete optimizer step:

* the measured peak never exceeds the plan's budget (the planner's promise);
* the predicted peak is within 3% of the measured one (issue 14's target);
* at every op the measured memory (the most since the previous op's issue) is at most the
  predicted one (the most the simulator holds over the same span) plus the Gloo scratch of the
  plan's largest gather call: its flat copy of the gathered bytes and its concatenated shards
  ((1 + 1/world) x the call's bytes). Why: Gloo runs the collective on its worker thread, which
  drops its work (and that scratch) shortly after the wait has returned; the model frees the
  scratch at the wait, so for an op or two after it the runtime can hold one call's scratch more.
  The same asynchrony (runs with less left over) is in the recorded activations, which is why the
  peak, not each op, is held to the 3%.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama.py")
STEPS = 6
PEAK_TOLERANCE = 0.03

pytestmark = pytest.mark.multiprocess

CONFIGS = {
    "zero3": ["--stage", "3"],
    "zero3-bf16-accum2": ["--stage", "3", "--param-dtype", "bfloat16", "--grad-accum", "2"],
    "zero2": ["--stage", "2"],
}


def dcplan_binary():
    build = os.environ.get("DCPLAN_BUILD_DIR")
    path = os.path.join(build, "bin", "dcplan") if build else None
    if not path or not os.path.exists(path):
        pytest.skip("the dcplan CLI is not built (DCPLAN_BUILD_DIR/bin/dcplan)")
    return path


def train(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
            "--steps", str(STEPS), *args]


def run(cmd, env=None, check=True):
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                         text=True, timeout=600)
    if check:
        assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def gloo_call_scratch(trace, plan):
    """(1 + 1/world) x the gathered bytes of the plan's largest gather call (a prefetch group or
    one parameter): Gloo's flat copy and the concatenated shards, which its worker thread may hold
    for a moment after the wait."""
    world = trace["meta"]["world_size"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[trace["meta"]["param_dtype"]]
    gathered = {p["id"]: p["shard_numel"] * world * size for p in trace["params"]}
    calls = [sum(gathered[i] for i in g["ds_ids"]) for graph in plan["graphs"] for g in graph["prefetch"]]
    largest = max(calls + list(gathered.values()))
    return largest + largest // world


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
    accepted = 0
    for factor in (0.97, 1.0, 1.04, 1.1):
        budget = int(default_peak * factor)
        plan = d / f"plan-{factor}.json"
        res = run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", str(budget)], check=False)
        if res.returncode != 0:
            assert "below what any schedule needs" in res.stderr, res.stderr
            continue
        accepted += 1
        curve = d / f"plan-{factor}.curve.json"
        run([exe, "inspect", str(plan), "--trace", str(trace), "--memory-curve", str(curve)])
        log = d / f"replay-{factor}.{{rank}}.jsonl"
        run(train(*args), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)})
        simulated = json.loads(curve.read_text())
        slack = gloo_call_scratch(json.loads(trace.read_text()), json.loads(plan.read_text()))
        for rank in range(2):
            events = dcplan_module.read_replay_log(str(log).replace("{rank}", str(rank)))
            assert dcplan_module.replay_differences(str(plan), events) == []
            cmp = dcplan_module.curve_comparison(simulated, events)
            where = f"{plan.name}, rank {rank}"
            assert len(cmp["ops"]) > 0, where
            measured, predicted = cmp["measured_peak"], cmp["predicted_peak"]
            assert measured <= budget, f"{where}: measured peak {measured} over the budget {budget}"
            assert abs(predicted - measured) <= PEAK_TOLERANCE * measured, \
                f"{where}: predicted peak {predicted}, measured {measured}"
            for graph, micro, pos, op, pred, meas in cmp["ops"]:
                assert meas <= pred + slack, \
                    f"{where}: graph {graph} micro-step {micro} pos {pos} ({op}): measured {meas}, predicted {pred}"
    assert accepted >= 2, "the sweep should leave at least two budgets the planner accepts"
