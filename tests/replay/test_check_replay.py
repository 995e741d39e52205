"""dcplan.check_replay's measurement half: step times and memory peaks read from a replay log's
marks, and the report against a plan's prediction and budget (no ranks: synthetic logs)."""
import pytest

from dcplan import _plan


def log(*steps, accum=1, eval_between=False):
    """A replay log: per optimizer step (t_us, peak_bytes) marks before each micro-step's forward."""
    events = [{"ev": "plan", "file": "p.json", "persistent": []}]
    for t, peak in steps:
        for micro in range(accum):
            events += [{"ev": "mark", "t_us": t + micro, "peak_bytes": peak}, {"ev": "start_forward"},
                       {"ev": "start_backward", "update": True, "sync": micro == accum - 1}]
        if eval_between:
            events += [{"ev": "mark", "t_us": t + 50, "peak_bytes": 1}, {"ev": "start_forward"}]
    return events


def test_step_time_is_the_median_between_step_starts_after_the_first():
    m = _plan.measured(log((0, 10), (1000, 30), (3000, 20), (4000, 20), (5500, 20)))
    # Intervals after the warm-up step: 2000, 1000, 1500.
    assert m == {"step_us": 1500, "steps": 3, "peak_bytes": 30}


def test_micro_steps_belong_to_their_optimizer_step():
    m = _plan.measured(log((0, 1), (100, 1), (300, 1), (500, 1), accum=4))
    assert m["step_us"] == 200 and m["steps"] == 2


def test_too_short_a_log_times_nothing():
    assert _plan.measured(log((0, 5), (100, 7))) == {"step_us": None, "steps": 0, "peak_bytes": 7}
    assert _plan.measured([]) == {"step_us": None, "steps": 0, "peak_bytes": None}


PLAN = {"source": {"trace": "t.json"}, "options": {"memory_budget_bytes": 100 * 2**20},
        "predicted": {"step_us": 20000.0, "peak_memory_bytes": 80 * 2**20}}


@pytest.mark.parametrize("peak,over", [(100 * 2**20, False), (100 * 2**20 + 1, True)])
def test_report_flags_a_peak_over_the_budget(peak, over):
    lines = _plan.prediction_report(PLAN, {"r.0.jsonl": {"step_us": 25000.0, "steps": 4, "peak_bytes": peak}})
    assert "  predicted" in lines[2] and "20.000 ms" in lines[2] and "80.0 MiB" in lines[2]
    assert "25.000 ms (+25%)" in lines[3] and "(4 steps timed)" in lines[3]
    assert lines[4] == "  budget: 100.0 MiB"
    assert any(line.startswith("OVER BUDGET: r.0.jsonl") for line in lines) == over


def test_report_without_a_budget_or_marks():
    plan = {**PLAN, "options": {}}
    lines = _plan.prediction_report(plan, {"r.0.jsonl": {"step_us": None, "steps": 0, "peak_bytes": None}})
    assert "budget: none" in lines[-1] and not any(line.startswith("OVER BUDGET") for line in lines)


def test_an_eval_forward_between_steps_keeps_the_step_time():
    # Step starts move to the eval forwards (50 us after each step's): the intervals stay.
    m = _plan.measured(log((0, 1), (100, 1), (300, 1), (500, 1), eval_between=True))
    assert m["step_us"] == 200 and m["steps"] == 3
