"""The runtime's budget guard on 2 CPU ranks: a plan made at a budget from a recording of
examples/train_llama.py, replayed where rank 1 holds memory the recording did not
(Inputs/train_with_ballast.py keeps BALLAST_BYTES beside the model there). Asserted: with the guard
switched off ($DCPLAN_BUDGET_GUARD=off) rank 1 crosses the budget (the premise: the plan alone does
not keep it); with it, every rank's peak stays within the budget, both ranks agreed on rank 1's
excess and held back exactly the same choices (their collectives stay in step), prefetches the
excess leaves room for still launch, `dcplan check` passes and lists the holds, each rank warns
once, and the losses equal training without a plan."""
import json
import os
import re
import subprocess
import sys

import pytest
from mp_harness import dcplan_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BALLAST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Inputs", "train_with_ballast.py")
# The promise test's model (not the demo's): activations large enough that prefetching matters.
MODEL = ["--layers", "3", "--hidden", "192", "--heads", "6", "--seq", "96", "--vocab", "768", "--fused"]
# The budget: this far from the gather-on-use peak towards the free plan's, so that the plan must
# prefetch less than it would, but still prefetches.
BUDGET_SHARE = 0.8

pytestmark = pytest.mark.multiprocess


def train(script, steps, device="cpu"):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
            "--steps", str(steps), "--device", device, *MODEL]


def run(cmd, env=None):
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, \
        f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def losses(out):
    return re.findall(r"^step +\d+ +loss (\S+)", out, re.M)


def test_prefetches_that_would_cross_the_budget_wait_and_the_budget_holds(tmp_path, dcplan_module):
    guard_case(tmp_path, "cpu")


def guard_case(tmp_path, device):
    """The case on 2 ranks of device ("cpu": Gloo; "cuda": NCCL, tests/gpu)."""
    from dcplan import _plan

    exe = dcplan_binary()
    example = os.path.join(ROOT, "examples", "train_llama.py")
    trace, free_plan, plan = tmp_path / "trace.json", tmp_path / "free.json", tmp_path / "plan.json"
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *train(example, 6, device)])
    run([exe, "plan", str(trace), "-o", str(free_plan)])
    free = json.loads(free_plan.read_text())
    on_use, free_peak = free["predicted_default"]["peak_memory_bytes"], free["predicted"]["peak_memory_bytes"]
    budget = int(on_use + BUDGET_SHARE * (free_peak - on_use))
    run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", f"{budget}B"])
    p = json.loads(plan.read_text())
    predicted = p["predicted"]["peak_memory_bytes"]
    peaks = [g.get("peak_bytes") for graph in p["graphs"] for g in graph["prefetch"]]
    assert peaks and all(0 < b <= predicted for b in peaks), p["graphs"]
    assert len(p["guard"]["persistent_peak_bytes"]) == len(p["persistent"]), p["guard"]
    # What the plan's choices add at the peak: the room the guard works in, at least what the memory
    # model can miss by, so that its error cannot decide the test: on Gloo up to 2% here, on NCCL
    # 0.2% (docs/planning.md, "What it does not cover"), each with a margin.
    room = predicted - on_use
    least = {"cpu": 0.025, "cuda": 0.005}[device]
    assert predicted <= budget and room >= least * predicted, (on_use, predicted, budget)
    # Memory the recording did not hold: without the guard the planned peak crosses the budget by
    # half the room; gathering on use keeps half the room under it.
    ballast = budget - (predicted + on_use) // 2
    env = {"DCPLAN_PLAN": str(plan), "BALLAST_BYTES": str(ballast), "BALLAST_RANK": "1"}

    unguarded_log = tmp_path / "off.{rank}.jsonl"
    run(train(BALLAST, 6, device), env={**env, "DCPLAN_BUDGET_GUARD": "off", "DCPLAN_REPLAY_LOG": str(unguarded_log)})
    unguarded = [_plan.measured(_plan.read_replay_log(str(unguarded_log).replace("{rank}", str(r))))["peak_bytes"]
                 for r in range(2)]
    # The premise: rank 1 holds the ballast beyond what rank 0 holds, and the plan's peak with it crosses the
    # budget. Measured on Gloo, rank 1's peak crosses it unless Gloo's worker had finished a gather whose flat
    # output the model holds until the wait (an upper bound: docs/planning.md, memory model): one CI run measured
    # both ranks 0.9 MB under the prediction, rank 1 then 79 KB under the budget. Rank 0 measures that shortfall
    # in the same run, so it is added back: rank 1's peak over rank 0's is the ballast, over the plan's peak.
    assert unguarded[1] - unguarded[0] >= 0.9 * ballast, ("rank 1 did not hold the ballast", unguarded, ballast)
    assert predicted + unguarded[1] - unguarded[0] > budget, ("the plan alone kept the budget: no premise",
                                                              unguarded, predicted, budget)

    log = tmp_path / "guarded.{rank}.jsonl"
    guarded = run(train(BALLAST, 6, device), env={**env, "DCPLAN_REPLAY_LOG": str(log)})
    reference = run(train(example, 6, device)).stdout
    assert losses(guarded.stdout) == losses(reference) and len(losses(reference)) == 6, (guarded.stdout, reference)
    assert guarded.stderr.count("BudgetGuardWarning") == 2, guarded.stderr  # once per rank
    logs = [str(log).replace("{rank}", str(r)) for r in range(2)]
    held = []
    for rank, path in enumerate(logs):
        events = _plan.read_replay_log(path)
        holds = _plan.budget_holds(events)
        assert holds, f"rank {rank} held nothing back"
        for h in holds:
            assert h["peak"] + h["excess"] > budget and (h["kind"] == "keep" or h["used_at"]), h
            assert h["excess"] >= ballast * 0.9, (h, ballast)  # rank 1's, on both ranks
        held.append([(h["step"], h["kind"], h["graph"], h["pos"], h["held"], h["excess"]) for h in holds])
        after = min(h["step"] for h in holds)
        launched = [e for ex in _plan.executions(events) if ex["step"] >= after for e in ex["events"]
                    if e["ev"] == "prefetch" and e["launched"]]
        fitting = sorted(b for b in peaks if b + holds[0]["excess"] <= budget)
        assert launched, (f"rank {rank}: no planned prefetch launched once the guard acted (from step {after}); "
                          f"agreed excess {holds[0]['excess']} (ballast {ballast}), groups whose peak fits beside "
                          f"it: {fitting}, holds: {[(h['step'], h['kind'], h['pos']) for h in holds][:12]}")
        peak = _plan.measured(events)["peak_bytes"]
        assert peak <= budget, (rank, peak, budget, unguarded)
    assert held[0] == held[1], "the ranks held back different choices"
    check = run([exe, "check", str(plan), *logs], env={"DCPLAN_PYTHON": sys.executable}).stdout
    assert check.count("follows") == 2 and "OVER BUDGET" not in check, check
    assert check.count("held back or dropped by the budget guard") == 2, check
    assert re.search(r"the budget guard held back \d+ planned prefetches and dropped \d+ copies", check), check
