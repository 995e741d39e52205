"""transformers models sharded on 2 Gloo ranks against one process, at every stage: losses and
parameters, greedy generate() between steps, and save_pretrained of the gathered state dict."""
import pytest
import torch

from mp_harness import entry, run_ranks
from train_harness import assert_trained_like

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh "
                                                          "installs it)")
import transformer_cases as tc  # noqa: E402

CASES = [(m, s) for m in tc.MODELS for s in (1, 2, 3)]
# Compiled replay (dcplan.shard(compile=True)) against the model under torch.compile.
COMPILED = [("llama", 3, True), ("gpt2", 3, True), ("llama-tied", 2, True)]
# fp32 on both sides, 2 ranks summing gradients in another order: the equivalence matrix's
# tolerances (tests/python/test_equivalence.py).
LOSS_TOL = dict(rtol=1e-5, atol=0)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def results(dcplan_module):
    return run_ranks(tc.worker, 2, CASES + COMPILED)


@pytest.mark.parametrize("kind,stage", CASES, ids=[f"{m}-zero{s}" for m, s in CASES])
def test_matches_single_process(results, kind, stage):
    res = entry(results, f"{kind}-zero{stage}")
    got, ref = res["value"], res["reference"]
    assert_trained_like(got, ref, LOSS_TOL, PARAM_TOL)
    assert got["tied"] == ref["tied"] == (kind != "llama")


@pytest.mark.parametrize("kind,stage,compiled", COMPILED, ids=[tc.case_name(*c) for c in COMPILED])
def test_compiled_matches_single_process_compiled(results, kind, stage, compiled):
    res = entry(results, tc.case_name(kind, stage, compiled))
    assert_trained_like(res["value"], res["reference"], LOSS_TOL, PARAM_TOL)
    assert res["value"]["tied"] == res["reference"]["tied"] == (kind != "llama")


@pytest.mark.parametrize("kind,stage", CASES, ids=[f"{m}-zero{s}" for m, s in CASES])
def test_generate_between_steps(results, kind, stage):
    res = entry(results, f"{kind}-zero{stage}")
    for step, (got, want) in enumerate(zip(res["value"]["generated"], res["reference"]["generated"])):
        assert torch.equal(got, want), f"step {step}: {got.tolist()} vs {want.tolist()}"


@pytest.mark.parametrize("kind,stage", CASES, ids=[f"{m}-zero{s}" for m, s in CASES])
def test_save_pretrained_of_the_full_state_dict(results, kind, stage):
    got = entry(results, f"{kind}-zero{stage}")["value"]
    assert got["reloaded_tied"] == got["tied"]
    assert sorted(got["reloaded"]) == sorted(got["params"])
    for name, want in got["params"].items():
        assert torch.equal(got["reloaded"][name], want), name


def test_example_saves_loads_and_resumes_exactly(dcplan_module, tmp_path):
    """examples/train_transformers.py as documented, on 2 CPU ranks: gradient accumulation, clipping,
    a warmup-cosine schedule and eval forwards; a DCP save halfway, a new model and optimizer loaded
    from it, the same losses as training straight through, and a save_pretrained directory
    from_pretrained reads."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "pretrained"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples/train_transformers.py"), "--steps", "6", "--save-at", "3", "--check-resume",
           "--accum", "2", "--eval-every", "2",
           "--activation-checkpointing", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-pretrained", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "its state equals the saved one bit for bit: yes" in r.stdout, r.stdout
    assert "resume exact: yes (3 steps after the load)" in r.stdout, r.stdout
    # The recipe: eval forwards between the steps (after steps 1, 3, 5 in each run), and a
    # warmup-cosine schedule that a resumed run takes up at its step (the same losses above).
    assert r.stdout.count("eval after step") == 6, r.stdout
    assert (tmp_path / "ckpt" / "step3" / ".metadata").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
