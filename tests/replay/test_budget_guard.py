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


# Recordings tried before the test gives up on its premise (see planned_premise).
ATTEMPTS = 3


def planned_premise(exe, trace, plan, device):
    """Records examples/train_llama.py and plans it at a budget, until the plan gives the guard room to act
    both ways: -> (plan, gather-on-use peak, budget, ballast).

    What the plan's choices add at the peak is the room the guard works in. The ballast (memory the
    recording did not hold) puts the unguarded peak three quarters of the room over the budget and the
    gather-on-use peak a quarter of it under. The split is uneven because the memory model errs unequally
    (docs/planning.md, memory model): on Gloo the measured peak falls below the modelled one by what the
    worker had already freed (a gather group's flat output, up to 0.9 MB, 3.3%, seen in CI) but rises
    above it by at most a bucket's scratch (196 KB, 0.7%, once in 100 loaded replays); on NCCL it is
    within 0.2% either way. So the room must exceed both errors on their sides: 4.5% on Gloo (the
    recordings here have 11-15%), 1% on NCCL (an H100 pair had 2.4%). And some planned prefetch must fit
    beside the ballast, or the guard could only hold back. Neither is the product's promise: the plan
    follows the recorded times, and a busy machine's recording can prefetch so far that every group's
    peak lies above that quarter (a CI run's did, with one forward group spanning the forward). Such a
    recording is retried; each attempt's figures are in the failure message.
    """
    example = os.path.join(ROOT, "examples", "train_llama.py")
    free_plan = plan.parent / "free.json"
    least = {"cpu": 0.045, "cuda": 0.01}[device]
    tried = []
    for _ in range(ATTEMPTS):
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
        assert predicted <= budget, (on_use, predicted, budget)
        room = predicted - on_use
        ballast = budget - on_use - room // 4
        fitting = [b for b in peaks if b + ballast <= budget]
        if room >= least * predicted and fitting:
            return p, on_use, budget, ballast
        tried.append(dict(on_use=on_use, predicted=predicted, budget=budget, room=room, ballast=ballast,
                          peaks_over_on_use=sorted(b - on_use for b in peaks)))
    raise AssertionError(f"no recording in {ATTEMPTS} left the guard room ({least:.1%} of the peak) with a "
                         f"prefetch fitting beside the ballast: {tried}")


def rule_kept(plan, events, holds, budget):
    """Asserts the guard's rule at every planned prefetch from the step it first acted in: a group is held
    back if and only if its peak plus the agreed excess crosses the budget. -> how many groups launched."""
    from dcplan import _plan

    excess, after = holds[0]["excess"], min(h["step"] for h in holds)
    groups = {graph["id"]: graph["prefetch"] for graph in plan["graphs"]}
    launched = 0
    for ex in _plan.executions(events):
        if ex["step"] < after:
            continue
        seen = {(e["pos"], tuple(e["ds_ids"])): e["ev"] for e in ex["events"]
                if e["ev"] == "prefetch" or (e["ev"] == "hold" and e.get("kind", "prefetch") == "prefetch")}
        for g in groups[ex["graph"]]:
            crosses = g["peak_bytes"] + excess > budget
            got = seen.get((g["position"], tuple(g["ds_ids"])))
            assert got == ("hold" if crosses else "prefetch"), (
                f"step {ex['step']}, graph {ex['graph']}, position {g['position']}: the group's peak "
                f"{g['peak_bytes']} plus the excess {excess} {'crosses' if crosses else 'fits'} the budget "
                f"{budget}, but the log has {got or 'nothing'} for it")
            launched += not crosses
    return launched


def guard_case(tmp_path, device):
    """The case on 2 ranks of device ("cpu": Gloo; "cuda": NCCL, tests/gpu)."""
    from dcplan import _plan

    exe = dcplan_binary()
    trace, plan = tmp_path / "trace.json", tmp_path / "plan.json"
    p, on_use, budget, ballast = planned_premise(exe, trace, plan, device)
    predicted = p["predicted"]["peak_memory_bytes"]
    peaks = [g["peak_bytes"] for graph in p["graphs"] for g in graph["prefetch"]]
    env = {"DCPLAN_PLAN": str(plan), "BALLAST_BYTES": str(ballast), "BALLAST_RANK": "1"}

    unguarded_log = tmp_path / "off.{rank}.jsonl"
    run(train(BALLAST, 6, device), env={**env, "DCPLAN_BUDGET_GUARD": "off", "DCPLAN_REPLAY_LOG": str(unguarded_log)})
    unguarded = [_plan.measured(_plan.read_replay_log(str(unguarded_log).replace("{rank}", str(r))))["peak_bytes"]
                 for r in range(2)]
    # The premise: with the ballast and without the guard, rank 1 crosses the budget. Rank 0 is no
    # baseline for it, since each rank's worker frees its scratch early or not: a CI run with the ballast
    # at half the room measured rank 1's peak only 1.78 MB over rank 0's with a 2.56 MB ballast.
    assert unguarded[1] > budget, ("the plan alone kept the budget: no premise",
                                   dict(unguarded=unguarded, predicted=predicted, on_use=on_use, budget=budget,
                                        ballast=ballast))

    log = tmp_path / "guarded.{rank}.jsonl"
    guarded = run(train(BALLAST, 6, device), env={**env, "DCPLAN_REPLAY_LOG": str(log)})
    reference = run(train(os.path.join(ROOT, "examples", "train_llama.py"), 6, device)).stdout
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
        assert rule_kept(p, events, holds, budget) > 0, f"rank {rank}: no planned prefetch launched once the guard acted"
        peak = _plan.measured(events)["peak_bytes"]
        assert peak <= budget, (rank, peak, budget, unguarded)
    assert held[0] == held[1], "the ranks held back different choices"
    check = run([exe, "check", str(plan), *logs], env={"DCPLAN_PYTHON": sys.executable}).stdout
    assert check.count("follows") == 2 and "OVER BUDGET" not in check, check
    assert check.count("held back or dropped by the budget guard") == 2, check
    assert re.search(r"the budget guard held back \d+ planned prefetches and dropped \d+ copies", check), check
