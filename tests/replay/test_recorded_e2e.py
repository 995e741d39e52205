"""record -> plan -> replay on real ranks: dcplan record of torchrun, dcplan plan, training with the plan."""
import json
import os
import subprocess
import sys

import dist_cases
import pytest
from mp_harness import dcplan_binary

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "Inputs", "train_tiny.py")
STEPS = 6

pytestmark = pytest.mark.multiprocess


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args]


def run(cmd, env=None):
    res = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.parametrize("stage", [1, 3])
def test_record_plan_replay(tmp_path, stage, dcplan_module):
    dcplan = dcplan_module
    exe = dcplan_binary()
    trace, plan = tmp_path / "trace.json", tmp_path / "plan.json"
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--",
         *torchrun(str(stage), str(STEPS), str(tmp_path))])
    run([exe, "plan", str(trace), "-o", str(plan)])
    p = json.loads(plan.read_text())
    assert p["source"]["world_size"] == 2 and p["source"]["stage"] == stage
    # The recorded inputs (each rank's slice of the batch) travel from the trace into the plan.
    recorded_shapes = [[dist_cases.BATCH // 2, dist_cases.SEQ]]
    assert [g["input_shapes"] for g in json.loads(trace.read_text())["steps"][0]["graphs"]
            if g["kind"] == "forward"] == [recorded_shapes]
    assert [g.get("input_shapes") for g in p["graphs"]] == [recorded_shapes, None]
    # The plan changes the schedule: something is prefetched or kept.
    assert p["persistent"] or any(g["prefetch"] for g in p["graphs"])
    run(torchrun(str(stage), str(STEPS), str(tmp_path)))
    log = tmp_path / "replay.{rank}.jsonl"
    replay = run(torchrun(str(stage), str(STEPS), str(tmp_path), str(plan)), env={"DCPLAN_REPLAY_LOG": str(log)})
    assert "InputShapeWarning" not in replay.stderr
    without = json.loads((tmp_path / "losses.json").read_text())
    with_plan = json.loads((tmp_path / "losses-plan.json").read_text())
    assert len(with_plan["losses"]) == STEPS
    assert with_plan["losses"] == pytest.approx(without["losses"], rel=1e-6, abs=0)
    assert with_plan["params"] == pytest.approx(without["params"], rel=1e-5, abs=1e-6)
    for rank in range(2):
        events = dcplan.read_replay_log(str(log).replace("{rank}", str(rank)))
        assert dcplan.replay_differences(str(plan), events) == []
        assert sum(e["ev"] == "flush" for e in events) >= STEPS  # every backward reduced through the plan
    logs = [str(log).replace("{rank}", str(r)) for r in range(2)]
    res = run([sys.executable, "-m", "dcplan.check_replay", str(plan), *logs])
    assert res.stdout.count(f"follows {plan}") == 2, res.stdout


def test_a_replay_whose_inputs_differ_from_the_recording_warns_once(tmp_path):
    exe = dcplan_binary()
    trace, plan = tmp_path / "trace.json", tmp_path / "plan.json"
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *torchrun("3", "4", str(tmp_path))])
    run([exe, "plan", str(trace), "-o", str(plan)])
    res = run(torchrun("3", "3", str(tmp_path), str(plan)), env={"TINY_ROWS": "4"})
    # Once per rank, naming the live and the recorded shapes and the plan.
    assert res.stderr.count("InputShapeWarning") == 2, res.stderr
    # ... at the line that called the model (dist_cases.loss_fn, for the script), not in torch or dcplan.
    assert all("dist_cases.py:" in line for line in res.stderr.splitlines() if "InputShapeWarning" in line), \
        res.stderr
    rows, seq = dist_cases.BATCH // 2, dist_cases.SEQ
    assert f"inputs have shapes [(4, {seq})]" in res.stderr and f"inputs had shapes [({rows}, {seq})]" in res.stderr, \
        res.stderr
    assert str(plan) in res.stderr
