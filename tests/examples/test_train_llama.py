"""examples/train_llama.py runs as documented, and its sharded runs on 2 CPU ranks
give the losses of the single-process reference on the same global batch."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples/train_llama.py"


def run(args, tmp_path, name, ranks=None):
    losses = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")  # DCPLAN_BUILD_DIR passes through
    if ranks:
        # --standalone: a rendezvous on a free port, so parallel runs do not collide.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(SCRIPT), *args, "--losses", str(losses)]
    else:
        cmd = [sys.executable, str(SCRIPT), *args, "--losses", str(losses)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(losses.read_text())["losses"], out.stdout


STEPS = ["--steps", "6"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, _ = run(["--no-shard", "--ranks", "2", *STEPS], tmp_path_factory.mktemp("ref"), "ref")
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_matches_single_process(tmp_path, reference, stage):
    losses, stdout = run([*STEPS, "--stage", str(stage)], tmp_path, f"z{stage}", ranks=2)
    assert f"dcplan ZeRO-{stage} on 2 ranks" in stdout
    assert losses == pytest.approx(reference, rel=1e-5)
    assert losses[-1] < losses[0] - 0.5  # it learns


def test_tied_head_with_accumulation_matches(tmp_path):
    args = ["--steps", "3", "--tied", "--grad-accum", "2"]
    ref, _ = run(["--no-shard", "--ranks", "2", *args], tmp_path, "tied-ref")
    losses, _ = run(args, tmp_path, "tied", ranks=2)
    assert losses == pytest.approx(ref, rel=1e-5)


def test_help_documents_the_flags():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--layers", "--hidden", "--tied", "--stage", "--param-dtype", "--no-shard"):
        assert flag in out.stdout


def test_bad_shape_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "100", "--heads", "3"], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "--hidden (100) must be a multiple of --heads (3)" in out.stderr
