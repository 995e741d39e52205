"""examples/torchtitan_dcplan.py: its parallelize_fn (torchtitan's signature) on a model built on
the meta device as torchtitan builds it trains on 2 CPU ranks as the unsharded model does, and
parallelisms dcplan does not do are refused by name."""
import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples/torchtitan_dcplan.py"


def test_trains_as_unsharded():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), OMP_NUM_THREADS="1")  # DCPLAN_BUILD_DIR passes through
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    steps = re.findall(r"step \d+: loss ([\d.]+) unsharded ([\d.]+)", out.stdout)
    assert len(steps) == 4, out.stdout
    # The equivalence matrix's fp32 tolerance (tests/python): 2 ranks sum in another order.
    assert [float(a) for a, _ in steps] == pytest.approx([float(b) for _, b in steps], rel=1e-5)


def test_other_parallelisms_are_refused():
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT / "python"))
    tt = pytest.importorskip("torchtitan_dcplan", reason="dcplan's extension is not built")
    settings = tt.torchtitan_settings(2)
    settings["parallel_dims"] = SimpleNamespace(**{**vars(settings["parallel_dims"]), "tp_enabled": True,
                                                   "dp_replicate_enabled": True})
    with pytest.raises(NotImplementedError, match="this job also enables tp, dp_replicate"):
        tt.parallelize_llama(tt.titan_style_llama(), **settings)
