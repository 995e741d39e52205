"""The GPU benchmark's bookkeeping that runs anywhere: how rounds of modes are merged."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("fsdp_vs_dcplan", ROOT / "bench/gpu/fsdp_vs_dcplan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_report_the_median_step_and_the_highest_peak():
    merge = _bench().merge_rounds
    rounds = [{"step_s": 0.080, "peak_bytes": 5, "setup_peak_bytes": 9, "losses": [1.0]},
              {"step_s": 0.055, "peak_bytes": 7, "setup_peak_bytes": 8, "losses": [2.0]},
              {"step_s": 0.060, "peak_bytes": 6, "setup_peak_bytes": 8, "losses": [3.0]}]
    r = merge(rounds)
    assert r["step_s"] == 0.060
    assert r["round_step_s"] == [0.080, 0.055, 0.060]
    assert r["peak_bytes"] == 7
    assert r["setup_peak_bytes"] == 9  # each peak the highest of its own
    assert r["losses"] == [3.0]  # the rest from the last round
    assert merge(rounds[:1]) == rounds[0]  # one round: as measured
    assert merge([{}, {}]) == {}  # the bound's other ranks report nothing


def test_a_transformers_llama_is_called_as_the_example_model():
    """--model transformers: ids in, logits out; FSDP2 reaches the decoder blocks through .layers,
    which does not register them twice."""
    import pytest
    import torch

    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                            tie_word_embeddings=False, attn_implementation="sdpa")
    lm = tf.LlamaForCausalLM(config)
    model = _bench().LogitsOf(lm)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(ids), lm(input_ids=ids).logits)
    assert model.layers is lm.model.layers and len(model.layers) == 2
    assert [n for n, _ in model.named_parameters()] == ["lm." + n for n, _ in lm.named_parameters()]


def _report(tmp_path, *args):
    """bench/gpu/predict_report.py with these arguments: (exit code, stdout, stderr)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "bench/gpu/predict_report.py"), *map(str, args)],
                       capture_output=True, text=True, cwd=tmp_path)
    return r.returncode, r.stdout, r.stderr


def _plan(tmp_path, name, step_us, peak, **options):
    import json

    path = tmp_path / name
    path.write_text(json.dumps({"predicted": {"step_us": step_us, "peak_memory_bytes": peak},
                                "predicted_default": {"peak_memory_bytes": 995},
                                "options": {"strategy": "optimized", **options}}))
    return path


def _steps(tmp_path, name, times_ms, peak=None):
    lines = [f"step {i:3d}  loss 10.0  {t:8.1f} ms" for i, t in enumerate(times_ms)]
    if peak is not None:
        lines.append(f"peak memory: {peak} bytes (torch.cuda.max_memory_allocated, the most over ranks)")
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_predict_report_compares_the_median_of_the_timed_steps_with_the_plan(tmp_path):
    plan = _plan(tmp_path, "p.json", 50_000, 2**30)
    # The first four steps are warm-up: their 900 ms would move a mean, not the median of the rest.
    a = _steps(tmp_path, "p.steps", [900, 900, 900, 900, 54, 55, 56], peak=2**30 + 2**27)
    b = _steps(tmp_path, "p.steps.2", [900, 900, 900, 900, 60, 60, 60], peak=2**30)
    rc, out, _ = _report(tmp_path, "one-run", a, plan)
    assert rc == 0 and "without the log: 55.000 ms (+10.0% against the predicted 50.000 ms; median of 3" in out
    rc, out, _ = _report(tmp_path, "rounds", "p", plan, a, b)
    assert rc == 0
    assert "predicted 50.0 ms, measured 57.5 ms (+15.0%), rounds 55.0 60.0" in out
    assert "peak predicted 1.00 GiB, measured 1.12 GiB (+12.5%)" in out  # the highest peak of the rounds


def test_predict_report_plan_options_budgets_and_errors(tmp_path):
    import json

    plan = _plan(tmp_path, "p.json", 50_000, 1000, memory_budget_bytes=1234)
    assert _report(tmp_path, "plan-args", plan)[1].split() == ["--strategy", "optimized", "--memory-budget", "1234"]
    assert _report(tmp_path, "budget", "1.5", plan)[1].strip() == "1500"
    assert _report(tmp_path, "default-budget", plan)[1].strip() == "1001"  # 995 / 0.995, rounded up
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"results": {"fsdp2": {"peak_bytes": 77}}}))
    assert _report(tmp_path, "bench-peak", results, "fsdp2")[1].strip() == "77"
    rc, _, err = _report(tmp_path, "bench-peak", results, "dcplan")
    assert rc != 0 and "expected results.dcplan.peak_bytes" in err
    rc, _, err = _report(tmp_path, "one-run", _steps(tmp_path, "short", [1, 2]), plan)
    assert rc != 0 and "expected more than 4 'step' lines, found 2" in err
    rc, _, err = _report(tmp_path, "no-such-report")
    assert rc != 0 and "unknown subcommand" in err


def test_predict_report_strips_op_device_us_only(tmp_path):
    import json

    trace = tmp_path / "t.json"
    event = {"op": "reduce_grad", "op_device_us": 3.0, "device_us": 7.0}
    trace.write_text(json.dumps({"steps": [{"graphs": [{"events": [event, {"op": "wait_allgather"}]}]}]}))
    assert _report(tmp_path, "strip-op-device", trace, tmp_path / "out.json")[0] == 0
    events = json.loads((tmp_path / "out.json").read_text())["steps"][0]["graphs"][0]["events"]
    assert events == [{"op": "reduce_grad", "device_us": 7.0}, {"op": "wait_allgather"}]


def test_memory_peak_names_what_is_live_at_the_first_highest_total():
    spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "bench/gpu/memory_peak.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    mib = 2**20

    def frames(line):  # torch's own frame first: the site is the first one outside torch
        return [{"filename": "/x/torch/nn/linear.py", "line": 1, "name": "forward"},
                {"filename": "/p/dcplan/_offload.py", "line": line, "name": "reload"}]

    events = [
        {"action": "segment_alloc", "addr": 0, "size": 8 * mib},
        {"action": "alloc", "addr": 1, "size": mib, "stream": 0, "frames": frames(10)},
        {"action": "alloc", "addr": 2, "size": 3 * mib, "stream": 7, "frames": frames(20)},
        {"action": "free_requested", "addr": 1, "size": mib, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 1, "size": mib, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 3, "size": mib, "stream": 0, "frames": frames(30)},  # 4 MiB again: not the first
        {"action": "free_requested", "addr": 9, "size": mib, "stream": 0, "frames": []},  # allocated before the trace
    ]
    report = mp.peak_report({"device_traces": [[], events]}, device=1).splitlines()
    assert report[0] == "7 events; peak 4.00 MiB live at event 2", report
    assert "1 frees of blocks allocated before the trace begins" in report[1], report
    assert report[3].split() == ["3.00", "MiB", "1", "blocks", "_offload.py:20", "reload"], report
    assert report[4].split() == ["1.00", "MiB", "1", "blocks", "_offload.py:10", "reload"], report
    assert any(line.startswith(" >") and "3.00 MiB stream   7" in line for line in report), report
