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

Why 5% and not the planner's 0.5% reserve: on Gloo a collective's scratch is freed by Gloo's
worker thread at a time of its own, which the model cannot know. Over this session's runs the
measured peak of one plan ranged from 4.5% below to 2.0% above its prediction (2.0% with other
tests beside it, 1.3% alone), so a plan can pass its budget by that much on Gloo ranks
(docs/planning.md, memory model). The 3% target of issue 14 and the budget without tolerance are
measured on a GPU, where the allocation order is the host's (docs/benchmarks.md, session 8).
"""
import json
import os
import subprocess
import sys

import pytest
from mp_harness import dcplan_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_llama.py")
STEPS = 6
GLOO_TIMING = 0.05
SANITY_SHARE = 0.90

pytestmark = pytest.mark.multiprocess

CONFIGS = {
    "zero3": ["--stage", "3"],
    "zero3-bf16-accum2": ["--stage", "3", "--param-dtype", "bfloat16", "--grad-accum", "2"],
    "zero2": ["--stage", "2"],
}


def train(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE,
            "--steps", str(STEPS), *args]


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
