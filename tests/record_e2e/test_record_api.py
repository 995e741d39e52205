"""dcplan.shard(record=...) and the DCPLAN_RECORD* settings on one in-process Gloo rank."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = pathlib.Path(__file__).resolve().parent / "Inputs" / "record_api.py"


def run(scenario, tmp_path, **extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", DCPLAN_RECORD_STEPS="2", DCPLAN_RECORD_WARMUP="1")
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DCPLAN_RECORD", None)
    env.update(extra)
    return subprocess.run([sys.executable, str(SCRIPT), scenario, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(autouse=True)
def _built():
    try:
        import dcplan  # noqa: F401
    except ImportError as e:
        pytest.skip(f"dcplan extension not importable: {e}")


def test_record_argument_names_the_directory(tmp_path):
    r = run("argument", tmp_path, DCPLAN_RECORD_EXIT="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 4" in r.stdout  # trained on after writing
    assert "steps 2 params ['0.weight', '0.bias', '2.weight', '2.bias']" in r.stdout
    assert "progress 2 2 1" in r.stdout
    assert "optimizer hook while recording True" in r.stdout
    assert "optimizer hook after False" in r.stdout  # removed once the trace is written
    assert "late: dcplan.shard: recording must be switched on at the first dcplan.shard() of the process" in r.stdout


def test_record_false_wins_over_the_environment(tmp_path):
    r = run("off", tmp_path, DCPLAN_RECORD=str(tmp_path), DCPLAN_RECORD_EXIT="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "files []" in r.stdout


def test_exit_ends_the_process_with_code_0_after_writing(tmp_path):
    r = run("exit", tmp_path, DCPLAN_RECORD=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 2" in r.stdout and "step 3" not in r.stdout  # the 4th forward writes and exits
    t = json.loads((tmp_path / "rank0.trace.json").read_text())
    assert t["meta"]["world_size"] == 1 and len(t["steps"]) == 2
    assert "not reached" not in r.stdout


@pytest.mark.parametrize("name,value,message", [
    ("DCPLAN_RECORD_WARMUP", "-1", "DCPLAN_RECORD_WARMUP should be an integer >= 0, got '-1'"),
    ("DCPLAN_RECORD_EXIT", "2", "DCPLAN_RECORD_EXIT should be 0 or 1, got '2'"),
    ("DCPLAN_RECORD_CALIBRATION_S", "0", "DCPLAN_RECORD_CALIBRATION_S should be a number of seconds > 0, got '0'"),
])
def test_bad_settings_are_named(tmp_path, name, value, message):
    r = run("exit", tmp_path, DCPLAN_RECORD=str(tmp_path), **{name: value})
    assert r.returncode != 0
    assert message in r.stderr
