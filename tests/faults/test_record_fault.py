"""`dcplan record` of a job whose rank is killed: it fails, writes no trace, and leaves neither
the rank directory nor a process behind."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/faults/Inputs/killed_rank_train.py"
DCPLAN = pathlib.Path(os.environ.get("DCPLAN_BIN", ROOT / "build/cpu/bin/dcplan"))


def test_a_killed_rank_under_record_leaves_nothing(tmp_path):
    output = tmp_path / "t.json"
    run = subprocess.run([str(DCPLAN), "record", "-o", str(output), "--", sys.executable, "-m",
                          "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode != 0, run.stderr[-2000:]
    assert "no trace written" in run.stderr, run.stderr[-2000:]
    assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no rank directory or partial trace left"
    left = subprocess.run(["pgrep", "-f", str(SCRIPT)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left: {left}"
