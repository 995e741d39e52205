"""Record mode of the real runtime: `dcplan record` on examples/train_llama.py (2 Gloo ranks),
the trace it writes, training numbers unchanged by recording, and real jobs that fail."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples/train_llama.py"


def dcplan_bin():
    path = os.environ.get("DCPLAN_BIN") or shutil.which("dcplan")
    if not path or not os.path.exists(path):
        pytest.skip("the dcplan executable is not built (set DCPLAN_BIN)")
    return path


def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("DCPLAN_RECORD", "DCPLAN_RECORD_STEPS", "DCPLAN_RECORD_WARMUP", "DCPLAN_RECORD_EXIT"):
        e.pop(k, None)
    e.update(extra)
    return e


def torchrun(*args, ranks=2):
    # --standalone: a rendezvous on a free port, so parallel runs do not collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(SCRIPT), *args]


@pytest.fixture(scope="module")
def dcplan_ok():
    try:
        import dcplan  # noqa: F401
    except ImportError as e:
        pytest.skip(f"dcplan extension not importable: {e}")
    return dcplan_bin()


@pytest.fixture(scope="module")
def recorded(dcplan_ok, tmp_path_factory):
    """`dcplan record -o t.json -- torchrun --nproc-per-node 2 examples/train_llama.py`, as documented."""
    out = tmp_path_factory.mktemp("rec") / "t.json"
    cmd = [dcplan_ok, "record", "-o", str(out), "--steps", "3", "--", *torchrun()]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


def test_record_writes_a_valid_trace_and_its_summary(recorded, dcplan_ok):
    out, r = recorded
    assert "/3 recorded on 2/2 ranks" in r.stderr  # progress files seen (the last one may be missed)
    assert "merged 2 rank traces" in r.stderr
    assert "dcplan.trace/v1" in r.stdout and "per step (mean of 3 recorded)" in r.stdout
    assert not pathlib.Path(str(out) + ".ranks").exists()
    v = subprocess.run([dcplan_ok, "validate", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "valid dcplan.trace/v1" in v.stdout
    i = subprocess.run([dcplan_ok, "inspect", str(out)], capture_output=True, text=True)
    assert i.returncode == 0, i.stderr
    assert "gloo" in i.stdout


def test_trace_content_matches_the_run(recorded):
    t = json.loads(recorded[0].read_text())
    meta = t["meta"]
    assert (meta["world_size"], meta["backend"], meta["stage"], meta["grad_accum_steps"]) == (2, "gloo", 3, 1)
    assert meta["device"] == "cpu" and meta["created_by"].startswith("dcplan-recorder ")
    assert meta["param_dtype"] == "float32" and "torch" in meta["versions"]
    names = [p["name"] for p in t["params"]]
    assert names[0] == "embed.weight" and "layers.1.mlp.w_down.weight" in names and names[-1] == "head.weight"
    ids = {p["id"] for p in t["params"]}
    assert t["memory"]["baseline_bytes"] > 0 and t["memory"]["capacity_bytes"] > t["memory"]["baseline_bytes"]
    for curve in ("all_gather", "reduce_scatter", "all_reduce"):
        pts = t["calibration"][curve]
        assert len(pts) >= 3 and pts[0]["bytes"] == 65536 and all(p["us"] > 0 for p in pts)
    # CPU ranks: the host pool's memcpy rate, each way (planned offload copies at it).
    assert t["calibration"]["h2d_gbps"] > 0 and t["calibration"]["d2h_gbps"] > 0
    # The ranks' compute, probed all at once (a --network what-if scales by it).
    assert t["calibration"]["compute_probe_us"] > 0
    # The optimizer's per-element state (the example's AdamW: exp_avg, exp_avg_sq) of each shard,
    # how it ran (torch's default on CPU tensors: one parameter at a time), in the one param group.
    for p in t["params"]:
        assert p["optimizer_state_bytes"] == 2 * 4 * p["shard_numel"], p
        assert p["optimizer_impl"] == "for_loop" and p["optimizer_group"] == 0, p
    assert [s["index"] for s in t["steps"]] == [0, 1, 2]
    sequences = []
    for s in t["steps"]:
        assert s["optimizer_us"] > 0
        fwd, bwd = s["graphs"]
        assert (fwd["kind"], bwd["kind"]) == ("forward", "backward")
        for g in (fwd, bwd):
            assert [e["seq"] for e in g["events"]] == list(range(len(g["events"])))
            for stream in ("compute", "allgather", "reduce"):
                starts = [e["start_us"] for e in g["events"] if e["stream"] == stream]
                assert starts == sorted(starts)
            assert all(e["end_us"] >= e["start_us"] >= 0 and e["memory_bytes"] > 0 for e in g["events"])
        ops = [e["op"] for e in fwd["events"]]
        # The hooks fuse each module's parameters: one prefetch per module owning several.
        assert ops[0] == "allgather_param" and ops.count("allgather_param") == len(ids)
        assert ops.count("release_param") == len(ids)
        gathers = [e for e in fwd["events"] if e["op"] == "allgather_param" and e["bytes"] > 0]
        assert all(e["bytes"] % (2 * 4) == 0 and e["dtype"] == "float32" for e in gathers)
        reduces = [e for e in bwd["events"] if e["op"] == "reduce_grad"]
        assert sorted(e["ds_id"] for e in reduces) == sorted(ids)
        assert all(e["stream"] == "reduce" and e["bytes"] > 0 for e in reduces)
        assert bwd["events"][-1]["op"] == "end_backward"
        waits = [e for e in fwd["events"] if e["op"] == "wait_allgather"]
        assert sum(e["end_us"] - e["start_us"] for e in waits) > 0
        sequences.append([(e["op"], e.get("ds_id")) for g in s["graphs"] for e in g["events"]])
    assert sequences[0] == sequences[1] == sequences[2]


def test_trace_has_host_times_and_the_planner_a_host_lane(recorded, dcplan_ok, tmp_path):
    trace_path = recorded[0]
    t = json.loads(trace_path.read_text())
    for s in t["steps"]:
        assert s["optimizer_host_us"] > 0
        for g in s["graphs"]:
            for e in g["events"]:
                # CPU ranks: one clock. The host's times are read inside the recorder's own work,
                # the device's marks outside it (which the device then runs through): so the
                # host's intervals lie within the device's (2 ns of rounding aside).
                # (The merge keeps each field's slowest rank: still within.)
                assert 0 <= e["host_us"] <= e["compute_us"] + 0.002, e
                assert e["issue_us"] >= 0, e
    plan = tmp_path / "plan.json"
    p = subprocess.run([dcplan_ok, "plan", str(trace_path), "-o", str(plan)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    i = subprocess.run([dcplan_ok, "inspect", str(plan), "--trace", str(trace_path)], capture_output=True,
                       text=True)
    assert i.returncode == 0, i.stderr
    assert "host lane: the host issues the step in" in i.stdout
    s = subprocess.run([dcplan_ok, "inspect", str(trace_path)], capture_output=True, text=True)
    assert "host time per step:" in s.stdout and "inside dc ops" in s.stdout


def losses_of(tmp_path, name, args, **extra):
    losses = tmp_path / f"{name}.json"
    r = subprocess.run(torchrun(*args, "--losses", str(losses)), capture_output=True, text=True,
                       env=env(**extra), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(losses.read_text())["losses"]


@pytest.mark.parametrize("args", [["--steps", "5"], ["--steps", "5", "--stage", "1", "--grad-accum", "2"]],
                         ids=["zero3", "zero1-accum"])
def test_recording_changes_no_number(dcplan_ok, tmp_path, args):
    plain = losses_of(tmp_path, "plain", args)
    rec_dir = tmp_path / "ranks"
    rec_dir.mkdir()
    recorded = losses_of(tmp_path, "recorded", args, DCPLAN_RECORD=str(rec_dir), DCPLAN_RECORD_STEPS="2",
                         DCPLAN_RECORD_WARMUP="1", DCPLAN_RECORD_EXIT="0")
    assert recorded == plain  # bit for bit: recording only observes
    assert len(recorded) == 5  # trained on after the trace was written
    for rank in (0, 1):
        t = json.loads((rec_dir / f"rank{rank}.trace.json").read_text())
        accum = 2 if "--grad-accum" in args else 1
        assert len(t["steps"]) == 2 * accum and t["meta"]["grad_accum_steps"] == accum
        assert (rec_dir / f"rank{rank}.progress").read_text() == "2 2 2\n"
        if accum == 2:
            # ZeRO-1 before the boundary only accumulates: nothing reduced, no optimizer.
            first, second = t["steps"][0], t["steps"][1]
            assert first["optimizer_us"] == 0 and second["optimizer_us"] > 0
            assert all(e["bytes"] == 0 for e in first["graphs"][1]["events"] if e["op"] == "reduce_grad")
            assert all(e["bytes"] > 0 for e in second["graphs"][1]["events"] if e["op"] == "reduce_grad")


def test_ranks_that_issue_different_ops_are_named(dcplan_ok, tmp_path):
    out = tmp_path / "diverge.json"
    script = pathlib.Path(__file__).resolve().parent / "Inputs" / "diverge.py"
    cmd = [dcplan_ok, "record", "-o", str(out), "--steps", "1", "--warmup", "1", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    # The first extra op: the layer's fused gather, or its first gather if the hooks see it held.
    assert re.search(r"/rank1\.trace\.json: /steps/0/graphs/0/events/14: rank 1 issued "
                     r"(prefetch_params_fused\(ds_ids 0,1\)|allgather_param\(ds_id 0\)) where rank 0 ended the "
                     r"graph \(step 0, forward graph 0, position 14\)", r.stderr), r.stderr
    assert "no trace written" in r.stderr and not out.exists()


def test_job_without_dcplan_records_nothing(dcplan_ok, tmp_path):
    out = tmp_path / "never.json"
    cmd = [dcplan_ok, "record", "-o", str(out), "--", *torchrun("--no-shard", "--steps", "2")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the command finished without recording" in r.stderr
    assert not out.exists() and not pathlib.Path(str(out) + ".ranks").exists()


def test_job_too_short_records_nothing(dcplan_ok, tmp_path):
    # 4 steps cannot hold 2 warm-up + 3 recorded ones and the forward after them.
    out = tmp_path / "short.json"
    cmd = [dcplan_ok, "record", "-o", str(out), "--", *torchrun("--steps", "4")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "the command finished after recording" in r.stderr, r.stderr
    assert "run at least 6 steps (2 warm-up, 3 recorded and 1 more, at whose forward the trace is written)" \
        in r.stderr, r.stderr
    assert not out.exists()


def test_failing_job_reports_its_exit_code(dcplan_ok, tmp_path):
    out = tmp_path / "fail.json"
    cmd = [dcplan_ok, "record", "-o", str(out), "--", *torchrun("--heads", "3")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dcplan: error: the command failed (exit code 1)" in r.stderr
    assert "last output of the command:" in r.stderr and "train_llama.py FAILED" in r.stderr  # torchrun's report
    # The script's own error, which torchrun's report pushed out of the last lines, once for both ranks.
    first = r.stderr.split("first errors in the command's output:\n", 1)[1].split("last output", 1)[0]
    assert first.count("train_llama.py: error: --hidden (128) must be a multiple of --heads (3)") == 1, r.stderr
    assert not out.exists()


def test_bad_settings_are_named(dcplan_ok, tmp_path):
    r = subprocess.run(torchrun("--steps", "2", ranks=1), capture_output=True, text=True,
                       env=env(DCPLAN_RECORD=str(tmp_path), DCPLAN_RECORD_STEPS="zero"), timeout=600)
    assert r.returncode != 0
    assert "DCPLAN_RECORD_STEPS should be an integer >= 1, got 'zero'" in r.stdout + r.stderr


def test_activation_checkpointing_is_recorded_planned_and_replayed(recorded, dcplan_ok, tmp_path):
    """train_llama --activation-checkpointing: the recomputation's re-gathers are backward-graph
    ops of the trace, the plan covers them, the replay follows it, and no number changes; and
    check_replay's report of the prediction against the run, and its budget check."""
    args = ["--activation-checkpointing", "--steps", "5"]
    trace, plan = tmp_path / "t.json", tmp_path / "p.json"
    ac = backward_gathers(dcplan_ok, trace, args)
    plain = gathers_in_backward(recorded[0])  # the same model without checkpointing
    # A block recomputed in backward gathers its parameters in forward order; without
    # checkpointing, backward re-gathers the saved ones as their gradients come, last first.
    layer1 = [n for n in ac if n.startswith("layers.1.")]
    assert layer1[0] == "layers.1.attn_norm.weight" and layer1[-1] == "layers.1.mlp.w_down.weight", ac
    assert plain.index("layers.1.mlp.w_down.weight") < plain.index("layers.1.attn.wq.weight"), plain
    p = subprocess.run([dcplan_ok, "plan", str(trace), "-o", str(plan)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    logs = str(tmp_path / "replay.{rank}.jsonl")
    planned = losses_of(tmp_path, "planned", args, DCPLAN_PLAN=str(plan), DCPLAN_REPLAY_LOG=logs)
    paths = [logs.format(rank=0), logs.format(rank=1)]
    c = check_replay(plan, paths)
    assert c.returncode == 0 and c.stdout.count(f"follows {plan}") == 2, c.stdout + c.stderr
    assert planned == losses_of(tmp_path, "plain", ["--steps", "5"])  # recomputation changes no number
    # check_replay's second half: the prediction next to each rank's step time and peak; the same
    # logs against the plan with a budget one byte below the measured peak: OVER BUDGET, exit 1.
    assert "prediction of t.json against the run:" in c.stdout and "(3 steps timed)" in c.stdout, c.stdout
    import dcplan

    peak = max(dcplan._plan.measured(dcplan.read_replay_log(p))["peak_bytes"] for p in paths)
    tight = json.loads(plan.read_text())
    tight["options"]["memory_budget_bytes"] = peak - 1
    (tmp_path / "tight.json").write_text(json.dumps(tight))
    c = check_replay(tmp_path / "tight.json", paths)
    assert c.returncode == 1 and "OVER BUDGET" in c.stdout, c.stdout + c.stderr


def check_replay(plan, logs):
    return subprocess.run([sys.executable, "-m", "dcplan.check_replay", str(plan), *logs], capture_output=True,
                          text=True, env=env())


def backward_gathers(dcplan_bin_path, out, args):
    """`dcplan record` of train_llama with args: the parameters the first recorded step's backward
    gathers, in order."""
    r = subprocess.run([dcplan_bin_path, "record", "-o", str(out), "--steps", "2", "--warmup", "1", "--",
                        *torchrun(*args)], capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return gathers_in_backward(out)


def gathers_in_backward(trace):
    """The parameters the first recorded step's backward in trace gathers, in order."""
    t = json.loads(trace.read_text())
    names = {p["id"]: p["name"] for p in t["params"]}
    return [names[e["ds_id"]] for e in t["steps"][0]["graphs"][1]["events"] if e["op"] == "allgather_param"]


def test_compiled_model_is_recorded_planned_and_replayed(dcplan_ok, tmp_path):
    """train_llama --compile (dcplan.shard(compile=True)): the trace holds the compiled graphs'
    ops, and the plan made from it is followed by the compiled replay without changing a number."""
    args = ["--compile", "--steps", "4"]
    trace, plan = tmp_path / "t.json", tmp_path / "p.json"
    gathers = backward_gathers(dcplan_ok, trace, args)
    assert json.loads(trace.read_text())["meta"]["replay"] == "compiled"
    # The backward gathers again what its gradients need (recomputed by the partitioner, never
    # saved): the output head's weight first, its gradient being the first to come.
    assert gathers and gathers[0] == "head.weight", gathers
    p = subprocess.run([dcplan_ok, "plan", str(trace), "-o", str(plan)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    i = subprocess.run([dcplan_ok, "inspect", str(plan)], capture_output=True, text=True)
    assert "ZeRO-3, grad accum 1, compiled" in i.stdout, i.stdout
    logs = str(tmp_path / "replay.{rank}.jsonl")
    planned = losses_of(tmp_path, "planned", args, DCPLAN_PLAN=str(plan), DCPLAN_REPLAY_LOG=logs)
    c = check_replay(plan, [logs.format(rank=0), logs.format(rank=1)])
    # Following it includes each persistent copy's end at its backward release before a step (the
    # compiled backward releases there; the planner's memory model drops it there).
    assert c.returncode == 0 and c.stdout.count(f"follows {plan}") == 2, c.stdout + c.stderr
    assert planned == losses_of(tmp_path, "plain", args)
    # The eager model refuses it (the other way round: test_plan_of_the_other_replay_mode_is_refused).
    r = subprocess.run(torchrun("--steps", "2"), capture_output=True, text=True, env=env(DCPLAN_PLAN=str(plan)),
                       timeout=600)
    assert r.returncode != 0
    assert f"{plan}: /source/replay: the plan was made from a trace of the compiled model, this run is eager" \
        in r.stderr, r.stderr[-3000:]


def test_plan_of_the_other_replay_mode_is_refused(recorded, dcplan_ok, tmp_path):
    """A plan records whether its trace came from the eager or the compiled model (their op
    sequences differ); the other mode refuses it at shard(), naming the file and the field."""
    eager_trace, eager_plan = recorded[0], tmp_path / "eager-plan.json"  # the eager model's trace
    assert "replay" not in json.loads(eager_trace.read_text())["meta"]  # absent: eager, as before the field
    p = subprocess.run([dcplan_ok, "plan", str(eager_trace), "-o", str(eager_plan)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    r = subprocess.run(torchrun("--compile", "--steps", "2"), capture_output=True, text=True,
                       env=env(DCPLAN_PLAN=str(eager_plan)), timeout=600)
    assert r.returncode != 0
    assert (f"{eager_plan}: /source/replay: the plan was made from a trace of the eager model, this run is "
            "compiled") in r.stderr, r.stderr[-3000:]
    # A plan for one CUDA graph per step (here the same schedule, marked so) is refused by a training
    # forward outside dcplan.graphed_step, naming both kinds and the file.
    graph_plan = tmp_path / "graph-plan.json"
    marked = json.loads(eager_plan.read_text())
    marked["options"]["cuda_graph"] = True
    graph_plan.write_text(json.dumps(marked))
    r = subprocess.run(torchrun("--steps", "2"), capture_output=True, text=True,
                       env=env(DCPLAN_PLAN=str(graph_plan)), timeout=600)
    assert r.returncode != 0
    assert (f"plan {graph_plan} was made for one CUDA graph per step (dcplan plan --cuda-graph, or a trace "
            "recorded through dcplan.graphed_step), and this forward runs outside dcplan.graphed_step") \
        in r.stderr, r.stderr[-3000:]


def test_eval_forwards_between_steps_are_not_recorded_as_steps(recorded, dcplan_ok, tmp_path):
    """An eval forward (no grad) after every step is neither a micro-step nor a graph run of the
    trace: the trace of the same job without it (the module's recording) has the same steps, graphs
    and ops."""
    out = tmp_path / "eval.json"
    r = subprocess.run([dcplan_ok, "record", "-o", str(out), "--steps", "3", "--", *torchrun("--eval-every", "1")],
                       capture_output=True, text=True, env=env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    evaluated, plain = json.loads(out.read_text()), json.loads(recorded[0].read_text())
    assert evaluated["meta"]["grad_accum_steps"] == plain["meta"]["grad_accum_steps"] == 1

    def shape(t):
        return [[(g["kind"], [(e["op"], e.get("ds_id")) for e in g["events"]]) for g in s["graphs"]]
                for s in t["steps"]]

    assert len(evaluated["steps"]) == 3
    assert shape(evaluated) == shape(plain)
    # A plan replayed with an eval forward after every step: followed, the same losses as without
    # eval, and the eval forwards' marks start no step (as many steps timed as without them).
    plan = tmp_path / "plan.json"
    (tmp_path / "plain-trace.json").write_text(json.dumps(plain))
    p = subprocess.run([dcplan_ok, "plan", str(tmp_path / "plain-trace.json"), "-o", str(plan)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    logs = str(tmp_path / "replay.{rank}.jsonl")
    with_eval = losses_of(tmp_path, "planned-eval", ["--steps", "5", "--eval-every", "1"], DCPLAN_PLAN=str(plan),
                          DCPLAN_REPLAY_LOG=logs)
    assert with_eval == losses_of(tmp_path, "unplanned", ["--steps", "5"])
    c = check_replay(plan, [logs.format(rank=0), logs.format(rank=1)])
    assert c.returncode == 0 and c.stdout.count(f"follows {plan}") == 2, c.stdout + c.stderr
    assert c.stdout.count("(3 steps timed)") == 2, c.stdout  # 5 steps: 4 intervals, the first left out
