"""Interrupting `dcplan record` (Ctrl-C, or a scheduler's SIGTERM) stops the whole
training command, reports it, and leaves neither a trace nor the rank directory."""
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests/lit/record/Inputs/fake_training.py"
DCPLAN = pathlib.Path(os.environ.get("DCPLAN_BIN", ROOT / "build/cpu/bin/dcplan"))


def running(marker):
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return out.stdout.split()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_interrupt_stops_the_command_and_writes_nothing(tmp_path, sig, code):
    if not DCPLAN.exists():
        pytest.skip(f"{DCPLAN} is not built")
    output = tmp_path / "t.json"
    # A unique world size marks this run's fake job so that we can look for leftovers.
    world = 1000 + uuid.uuid4().int % 1000
    marker = f"fake_training.py hang --world-size {world}"
    proc = subprocess.Popen([str(DCPLAN), "record", "-o", str(output), "--", sys.executable, str(FAKE), "hang",
                             "--world-size", str(world)], stderr=subprocess.PIPE, text=True)
    # Wait for the first progress line: recording is under way.
    deadline = time.monotonic() + 30
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "recorded on" in line or time.monotonic() > deadline:
            break
    assert any("step 1/3 recorded on" in l for l in lines), lines
    proc.send_signal(sig)
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == code
    assert "stopping the command" in rest
    assert rest.rstrip().endswith("dcplan: error: interrupted: no trace written")
    assert not output.exists()
    assert not pathlib.Path(str(output) + ".ranks").exists()
    assert running(marker) == []
