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
    rounds = [{"step_s": 0.080, "peak_bytes": 5, "losses": [1.0]},
              {"step_s": 0.055, "peak_bytes": 7, "losses": [2.0]},
              {"step_s": 0.060, "peak_bytes": 6, "losses": [3.0]}]
    r = merge(rounds)
    assert r["step_s"] == 0.060
    assert r["round_step_s"] == [0.080, 0.055, 0.060]
    assert r["peak_bytes"] == 7
    assert r["losses"] == [3.0]  # the rest from the last round
    assert merge(rounds[:1]) == rounds[0]  # one round: as measured
    assert merge([{}, {}]) == {}  # the bound's other ranks report nothing
