"""dcplan.check_replay's measurement half: step times and memory peaks read from a replay log's
marks, and the report against a plan's prediction and budget (no ranks: synthetic logs)."""
import re

import pytest

from dcplan import _plan


def log(*steps, accum=1, eval_between=False, log_us=None, taken_out=False):
    """A replay log: per optimizer step (t_us, peak_bytes) marks before each micro-step's forward;
    log_us: the log's own host time a step (its marks' log_us), taken_out: marked so (CPU ranks)."""
    events = [{"ev": "plan", "file": "p.json", "persistent": []}]
    for i, (t, peak) in enumerate(steps):
        for micro in range(accum):
            mark = {"ev": "mark", "t_us": t + micro, "peak_bytes": peak}
            if log_us is not None:
                mark["log_us"] = i * log_us + micro
                if taken_out:
                    mark["log_taken_out"] = True
            events += [mark, {"ev": "start_forward"},
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
    # 25% over: the way to plan again from this run.
    assert lines[4].startswith("  the step missed its prediction by more than 10%: `dcplan plan t.json -o PLAN "
                               "--memory-budget 104857600 --calibrate r.0.jsonl` plans again"), lines
    assert lines[5] == "  budget: 100.0 MiB"
    assert any(line.startswith("OVER BUDGET: r.0.jsonl") for line in lines) == over


@pytest.mark.parametrize("step_us,hinted", [(21900.0, False), (22100.0, True), (17900.0, True)])
def test_a_step_beyond_ten_percent_of_its_prediction_points_to_calibrate(step_us, hinted):
    lines = _plan.prediction_report(PLAN, {"r.0.jsonl": {"step_us": step_us, "steps": 4, "peak_bytes": 1}})
    assert any("--calibrate r.0.jsonl" in line for line in lines) == hinted, lines


def test_the_calibrate_hint_keeps_the_plans_options_and_names_only_timed_logs():
    plan = {"source": {"trace": "t.json", "world_size": 4},
            "options": {"strategy": "heuristic", "bandwidth_gbps": 25.0},
            "predicted": {"step_us": 20000.0, "peak_memory_bytes": 1}}
    runs = {"r.0.jsonl": {"step_us": 30000.0, "steps": 4, "peak_bytes": 1},
            "r.1.jsonl": {"step_us": None, "steps": 0, "peak_bytes": 1}}
    hint = [line for line in _plan.prediction_report(plan, runs) if "--calibrate" in line]
    assert len(hint) == 1 and "`dcplan plan t.json -o PLAN --world-size 4 --strategy heuristic --bandwidth 25 " \
                              "--calibrate r.0.jsonl`" in hint[0], hint


def test_a_graphs_replays_point_to_calibrating_the_devices_pace():
    """A graphed run's replays, timed on the device, calibrate too (dcplan plan --calibrate fits the
    device's times); the hint keeps the plan for the graph."""
    plan = {"source": {"trace": "t.json", "world_size": 1}, "options": {"cuda_graph": True},
            "predicted": {"step_us": 26000.0, "peak_memory_bytes": 1}}
    runs = {"r.0.jsonl": {"step_us": 22000.0, "steps": 20, "peak_bytes": 1, "warmup_peak_bytes": 1}}
    hint = [line for line in _plan.prediction_report(plan, runs) if "--calibrate" in line]
    assert len(hint) == 1 and "`dcplan plan t.json -o PLAN --world-size 1 --cuda-graph --calibrate r.0.jsonl`" \
        in hint[0] and "its device's pace" in hint[0], hint


def test_report_without_a_budget_or_marks():
    plan = {**PLAN, "options": {}}
    lines = _plan.prediction_report(plan, {"r.0.jsonl": {"step_us": None, "steps": 0, "peak_bytes": None}})
    assert "budget: none" in lines[-1] and not any(line.startswith("OVER BUDGET") for line in lines)


def test_an_eval_forward_between_steps_keeps_the_step_time():
    # Step starts move to the eval forwards (50 us after each step's): the intervals stay.
    m = _plan.measured(log((0, 1), (100, 1), (300, 1), (500, 1), eval_between=True))
    assert m["step_us"] == 200 and m["steps"] == 3


def timed_log(step_starts, op_offsets):
    """A replay log of one forward (graph 0) and one backward (graph 1) per optimizer step:
    op_offsets are the op lines' times from each step's start mark."""
    events = [{"ev": "plan", "file": "p.json", "persistent": []}]
    for t in step_starts:
        events += [{"ev": "mark", "t_us": t, "peak_bytes": 1}, {"ev": "start_forward"}]
        for pos, dt in enumerate(op_offsets[:2]):
            events.append({"ev": "op", "graph": 0, "pos": pos, "op": "allgather_param", "ds_id": 7, "t_us": t + dt})
        events.append({"ev": "start_backward", "update": True, "sync": True})
        events.append({"ev": "op", "graph": 1, "pos": 0, "op": "end_backward", "ds_id": -1, "t_us": t + op_offsets[2]})
    return events


CURVE = {"step_us": 1000.0, "host_lane": True, "samples": [
    {"graph": 0, "kind": "forward", "micro_step": 0, "pos": 0, "op": "allgather_param", "host_us": 10.0},
    {"graph": 0, "kind": "forward", "micro_step": 0, "pos": 1, "op": "allgather_param", "host_us": 100.0},
    {"graph": 1, "kind": "backward", "micro_step": 0, "pos": 0, "op": "end_backward", "host_us": 600.0}]}


def test_time_comparison_reads_the_last_complete_step_from_its_start_mark():
    # Three steps: the last one may be cut short; the second (start 5000, next 6500) is compared.
    events = timed_log([0, 5000, 6500], [20, 400, 700])
    c = _plan.time_comparison(CURVE, events)
    assert c["predicted_step_us"] == 1000.0 and c["measured_step_us"] == 1500
    assert [(r.graph, r.pos, r.predicted_us, r.measured_us, r.kind) for r in c["ops"]] == [
        (0, 0, 10.0, 20, "forward"), (0, 1, 100.0, 400, "forward"), (1, 0, 600.0, 700, "backward")]


def test_time_report_names_the_stretches_the_prediction_misses_most():
    lines = _plan.time_report("r.0.jsonl", _plan.time_comparison(CURVE, timed_log([0, 5000, 6500], [20, 400, 700])))
    assert "first backward op 0.600 / 0.700" in lines[0] and "step 1.000 / 1.500 (+50%)" in lines[0]
    # The stretches, measured - predicted: before op 0, 20 - 10 = +10 us; before op 1, 380 - 90 =
    # +290 us; before end_backward, 300 - 500 = -200 us; after the last op, 800 - 400 = +400 us.
    assert lines[1].startswith("    after the last op") and "(+0.400 ms)" in lines[1]
    assert "before graph 0 micro-step 0 pos 1 allgather_param (ds_id 7)" in lines[2] and "(+0.290 ms)" in lines[2]
    assert "pos 0 end_backward" in lines[3] and "(-0.200 ms)" in lines[3] and len(lines) == 4  # no kind recurs


def test_time_report_sums_the_stretches_of_a_kind_that_recurs():
    # Six forward gathers, each issued 30 us after the one before where 10 were predicted (+20 us each);
    # end_backward's stretch (-140 us) is one of its kind.
    samples = [{"graph": 0, "kind": "forward", "micro_step": 0, "pos": i, "op": "allgather_param",
                "host_us": 10.0 * (i + 1)} for i in range(6)]
    samples.append({"graph": 1, "kind": "backward", "micro_step": 0, "pos": 0, "op": "end_backward",
                    "host_us": 600.0})
    curve = {"step_us": 1000.0, "host_lane": True, "samples": samples}
    events = [{"ev": "plan", "file": "p.json", "persistent": []}]
    for t in (0, 5000, 6500):
        events += [{"ev": "mark", "t_us": t, "peak_bytes": 1}, {"ev": "start_forward"}]
        events += [{"ev": "op", "graph": 0, "pos": i, "op": "allgather_param", "ds_id": i, "t_us": t + 10 + 30 * i}
                   for i in range(6)]
        events += [{"ev": "start_backward", "update": True, "sync": True},
                   {"ev": "op", "graph": 1, "pos": 0, "op": "end_backward", "ds_id": -1, "t_us": t + 560}]
    lines = _plan.time_report("r.0.jsonl", _plan.time_comparison(curve, events))
    at = lines.index("    by kind of stretch (the op before -> the op), where it recurs:")
    # The first gather's stretch is the step's start's, one of its kind: only the five after it recur.
    assert lines[at + 1:] == ["      forward allgather_param -> allgather_param: 5 stretches, predicted 10.0 us and "
                              "measured 30.0 us each (+0.100 ms)"]


def test_logs_or_curves_without_times_say_why_they_compare_nothing():
    events = timed_log([0, 5000, 6500], [20, 400, 700])
    untimed = [{k: v for k, v in e.items() if not (e["ev"] == "op" and k == "t_us")} for e in events]
    assert "op lines have no times" in _plan.time_comparison(CURVE, untimed)["reason"]
    old_curve = {"samples": [{k: v for k, v in s.items() if k != "host_us"} for s in CURVE["samples"]]}
    assert "curve has no op times" in _plan.time_comparison(old_curve, events)["reason"]
    assert "no complete optimizer step" in _plan.time_comparison(CURVE, events[:8])["reason"]
    line = _plan.time_report("r.0.jsonl", _plan.time_comparison(CURVE, untimed))[0]
    assert line.startswith("  r.0.jsonl: op times not compared: the log's op lines have no times")


def test_a_curve_op_the_log_lacks_is_named():
    other = {**CURVE, "samples": CURVE["samples"] + [
        {"graph": 1, "kind": "backward", "micro_step": 0, "pos": 5, "op": "reduce_grad", "host_us": 700.0}]}
    reason = _plan.time_comparison(other, timed_log([0, 5000, 6500], [20, 400, 700]))["reason"]
    assert "has no op at graph 1 micro-step 0 position 5 (reduce_grad)" in reason


def test_an_eval_forward_in_the_step_is_not_taken_for_the_training_one():
    events = timed_log([0, 5000, 6500], [20, 400, 700])
    # An eval forward (graph 0, no backward) right after step 0's backward: it belongs to step 1.
    at = next(i for i, e in enumerate(events) if e.get("op") == "end_backward") + 1
    events[at:at] = [{"ev": "mark", "t_us": 900, "peak_bytes": 1}, {"ev": "start_forward"},
                     {"ev": "op", "graph": 0, "pos": 0, "op": "allgather_param", "ds_id": 7, "t_us": 905}]
    reason = _plan.time_comparison(CURVE, events)["reason"]
    assert "runs graph 0 2 times, the plan's step 1 (a forward outside training" in reason


def test_without_a_host_lane_the_report_says_the_predicted_times_are_the_devices():
    c = _plan.time_comparison({**CURVE, "host_lane": False}, timed_log([0, 5000, 6500], [20, 400, 700]))
    assert "predicted times are the device's" in _plan.time_report("r.0.jsonl", c)[1]


def test_the_check_names_a_file_it_cannot_read_and_exits_2(tmp_path, capsys):
    plan = tmp_path / "p.json"
    plan.write_text('{"source": {"stage": 3}, "persistent": [], "graphs": []}')
    assert _plan.main([str(plan), str(tmp_path / "missing.jsonl")]) == 2
    assert f"error: {tmp_path / 'missing.jsonl'}: [Errno 2]" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert _plan.main([str(plan), str(bad)]) == 2
    assert f"error: {bad}: Expecting property name" in capsys.readouterr().err


def test_chrome_trace_has_the_predicted_lane_and_one_per_rank(tmp_path):
    comparisons = {f"r.{r}.jsonl": _plan.time_comparison(CURVE, timed_log([0, 5000, 6500], [20, 400, 700 + r]))
                   for r in range(2)}
    out = tmp_path / "t.json"
    _plan.write_chrome_trace(str(out), "plan.json", comparisons)
    import json

    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "predicted: plan.json", 2: "measured: r.0.jsonl", 3: "measured: r.1.jsonl"}
    slices = {pid: [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["pid"] == pid]
              for pid in names}
    assert slices[1] == [("allgather_param 7", 10.0, 90.0), ("allgather_param 7", 100.0, 500.0),
                         ("end_backward -1", 600.0, 400.0)]
    assert slices[3][-1] == ("end_backward -1", 701.0, 799.0)  # to the next step's start, 1500 us
    assert not list(tmp_path.glob("*.tmp*"))
    with pytest.raises(ValueError, match="no log's op times compare with the curve's .r.0.jsonl: why."):
        _plan.write_chrome_trace(str(out), "plan.json", {"r.0.jsonl": {"reason": "why"}})


def graphed_log(device_us, capture_peak, replay_peak, warmup_peak):
    """A graphed step's log: two uncaptured warm-up steps (marks), the capture, then the replays."""
    events = log((0, warmup_peak), (1000, warmup_peak))
    events.append({"ev": "graph_capture", "capture_s": 2.5, "peak_bytes": capture_peak})
    events += [{"ev": "graph_replay", "replay": i, "device_us": us, "peak_bytes": replay_peak}
               for i, us in enumerate(device_us)]
    return events


def test_a_graphed_log_is_timed_by_its_replays_on_the_device():
    m = _plan.measured(graphed_log([90000.0, 21000.0, 19000.0, 20500.0], 90, 90, 70))
    # The median of the replays after the first, which uploads the graph (the host times of the
    # uncaptured steps are not the graphed step's); the rule of dcplan plan --calibrate.
    assert m == {"step_us": 20500.0, "steps": 3, "peak_bytes": 90, "warmup_peak_bytes": 70, "capture_s": 2.5}
    # Fewer than 3 after the first: not timed.
    assert _plan.measured(graphed_log([90000.0, 21000.0, 19000.0], 90, 90, 70))["step_us"] is None
    # An eval forward after the capture (its mark carries the run's peak so far) is not a step
    # before the capture: its memory is in the capture's statistic.
    after = graphed_log([90000.0, 21000.0, 19000.0, 20500.0], 90, 90, 70)
    after.append({"ev": "mark", "t_us": 9000, "peak_bytes": 95, "grad": False})
    assert _plan.measured(after)["warmup_peak_bytes"] == 70
    lines = _plan.prediction_report(PLAN, {"r.0.jsonl": m})
    assert "20.500 ms (+2%)" in lines[3] and "(3 graph replays timed on the device, after the first)" in lines[3]
    # Captured again (a new graph): its own replays, after its own first.
    again = graphed_log([90000.0, 21000.0, 19000.0, 20500.0], 90, 90, 70)
    again.append({"ev": "graph_capture", "capture_s": 1.0, "peak_bytes": 90})
    again += [{"ev": "graph_replay", "replay": i, "device_us": us, "peak_bytes": 90}
              for i, us in enumerate([80000.0, 30000.0, 31000.0, 29000.0, 30500.0])]
    m = _plan.measured(again)
    assert (m["step_us"], m["steps"]) == (30250.0, 4)
    # Too few replays to time: the report says so.
    few = _plan.measured(graphed_log([90000.0, 21000.0], 90, 90, 70))
    line = _plan.prediction_report(PLAN, {"r.0.jsonl": few})[3]
    assert "(fewer than 4 graph replays: not timed)" in line and " - " in line, line
    assert "  r.0.jsonl: captured in 2.50 s; uncaptured steps before it peaked at 0.0 MiB" in lines


@pytest.mark.parametrize("capture,warmup,over", [(100 * 2**20, 90 * 2**20, []),
                                                  (100 * 2**20 + 1, 90 * 2**20, ["peak"]),
                                                  (90 * 2**20, 100 * 2**20 + 1, ["uncaptured steps' peak"])])
def test_a_graphed_run_keeps_its_budget_in_the_graph_and_before_it(capture, warmup, over):
    m = _plan.measured(graphed_log([20000.0], capture, 80 * 2**20, warmup))
    lines = _plan.prediction_report(PLAN, {"r.0.jsonl": m})
    flagged = [re.match(r"OVER BUDGET: r\.0\.jsonl: (.*) [\d.]+ MiB > budget", line) for line in lines
               if line.startswith("OVER BUDGET")]
    assert [f.group(1) for f in flagged] == over


@pytest.mark.parametrize("taken_out", [True, False])
def test_the_logs_own_time_a_step_is_reported_and_where_it_is(taken_out):
    m = _plan.measured(log((0, 10), (1000, 30), (2000, 20), (3000, 20), log_us=340, taken_out=taken_out))
    assert m["step_us"] == 1000 and m["log_us"] == 340 and m["log_taken_out"] == taken_out
    lines = _plan.prediction_report(PLAN, {"r.0.jsonl": m})
    assert lines[-2].startswith("  the replay logs' own host time a step: 0.340 ms (r.0.jsonl), "), lines
    assert ("left out of the steps above" in lines[-2]) == taken_out, lines
    assert lines[-1] == "  budget: 100.0 MiB"
    # An older log (no log_us) says nothing of it.
    assert "log_us" not in _plan.measured(log((0, 10), (1000, 30), (3000, 20)))
