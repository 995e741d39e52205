"""The plan's promise on 2 CPU ranks, for a model and sizes the demo does not use: two rounds of
dcplan record -> plan (unconstrained, and at a budget between the least any schedule needs and the
unconstrained plan's peak) -> replay with the replay log -> check (`dcplan check` for one plan,
`python -m dcplan.check_replay` for the other). Asserted: every rank's measured peak within 3% of
the plan's prediction and within its budget, and the check's time report and Chrome trace. The
step time is a benchmark (docs/benchmarks.md), not asserted here: two processes on a 2-core
machine vary 2x from step to step."""
import json
import os
import subprocess
import sys

import pytest
from mp_harness import dcplan_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Not the demo's sizes (2 layers, hidden 128, unfused): fused q/k/v and gate/up projections.
MODEL = ["--layers", "3", "--hidden", "192", "--heads", "6", "--seq", "96", "--vocab", "768", "--fused"]
# The target for the peak (docs/planning.md: the model errs by up to 2% on Gloo here).
PEAK_TOLERANCE = 0.03

pytestmark = pytest.mark.multiprocess


def train(steps):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(ROOT, "examples", "train_llama.py"), "--steps", str(steps), *MODEL]


def run(cmd, env=None):
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, \
        f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def replay_and_check(exe, tmp, name, trace, via_cli):
    """Replays tmp/name.json with the replay log and checks it (via_cli: with `dcplan check --trace`, else
    with `dcplan inspect --memory-curve` and `python -m dcplan.check_replay --curve`); returns the plan,
    each rank's measurement, the check's output and its Chrome trace."""
    from dcplan import _plan

    plan = tmp / f"{name}.json"
    log = tmp / f"{name}.{{rank}}.jsonl"
    run(train(6), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)})
    logs = [str(log).replace("{rank}", str(r)) for r in range(2)]
    chrome = tmp / f"{name}.chrome.json"
    if via_cli:
        check = run([exe, "check", str(plan), *logs, "--trace", str(trace), "--chrome-trace", str(chrome)],
                    env={"DCPLAN_PYTHON": sys.executable})
    else:
        curve = tmp / f"{name}.curve.json"
        run([exe, "inspect", str(plan), "--trace", str(trace), "--memory-curve", str(curve)])
        check = run([sys.executable, "-m", "dcplan.check_replay", str(plan), *logs, "--curve", str(curve),
                     "--chrome-trace", str(chrome)])
    measured = [_plan.measured(_plan.read_replay_log(p)) for p in logs]
    return json.loads(plan.read_text()), measured, check.stdout, json.loads(chrome.read_text())


@pytest.mark.parametrize("round_", [1, 2])
def test_each_rank_keeps_the_plans_peak_and_budget(tmp_path, round_, dcplan_module):
    exe = dcplan_binary()
    trace = tmp_path / "trace.json"
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *train(6)])
    # Recorded without the agreement checks its replay makes on CPU ranks (auto): the trace says so.
    assert json.loads(trace.read_text())["meta"]["checks_collectives"] is True
    run([exe, "plan", str(trace), "-o", str(tmp_path / "free.json")])
    free = json.loads((tmp_path / "free.json").read_text())
    least = free["predicted_default"]["peak_memory_bytes"]  # gather on use: the least any schedule needs
    most = free["predicted"]["peak_memory_bytes"]
    assert most > least * 1.05, f"the unconstrained plan's peak {most} leaves no budget between it and {least}"
    budget = (least + most) // 2
    run([exe, "plan", str(trace), "-o", str(tmp_path / "budget.json"), "--memory-budget", f"{budget}B"])
    for name in ("free", "budget"):
        plan, ranks, out, chrome = replay_and_check(exe, tmp_path, name, trace, via_cli=name == "budget")
        predicted = plan["predicted"]["peak_memory_bytes"]
        if name == "budget":
            assert plan["options"]["memory_budget_bytes"] == budget and predicted <= budget
        for rank, m in enumerate(ranks):
            where = f"round {round_}, plan {name}, rank {rank}"
            assert abs(m["peak_bytes"] / predicted - 1) <= PEAK_TOLERANCE, (where, m["peak_bytes"], predicted)
            if name == "budget":
                assert m["peak_bytes"] <= budget, (where, m["peak_bytes"], budget)
            assert m["step_us"] is not None and m["steps"] >= 3, (where, m)
        assert out.count("follows") == 2 and "OVER BUDGET" not in out, out
        assert "host time per op" in out and out.count("ms from the step's start, predicted / measured") == 2, out
        lanes = [e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "process_name"]
        assert lanes == [f"predicted: {name}.json", f"measured: {name}.0.jsonl", f"measured: {name}.1.jsonl"]
