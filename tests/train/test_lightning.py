"""Trainer(strategy="dcplan") on 2 CPU processes: the same losses and parameters as plain PyTorch
in one process, with gradient clipping (gradient_clip_val) and accumulation; a checkpoint (a DCP
directory in the original shapes) resumes the run exactly."""
import os
import socket
import tempfile

import pytest
import torch

import interop_cases as ic
import lightning_cases as lc
from mp_harness import entry, run_ranks

pytestmark = pytest.mark.multiprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(dcplan_module):
    pytest.importorskip("lightning", reason="lightning is not installed (scripts/setup.sh installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "epoch1")
        results = run_ranks(lc.worker, 2, free_port(), ckpt)
        entry(results, "lightning")  # each rank's error, if one failed
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt, os.path.join(tmp, "epoch1.pt"))
        converted = torch.load(os.path.join(tmp, "epoch1.pt"), weights_only=False)
        yield results, converted


def test_trains_like_plain_pytorch(run):
    """The ranks' mean loss per micro-batch and the final parameters against one process
    (the equivalence matrix's fp32 tolerances, tests/python: 2 ranks sum in another order)."""
    results, _ = run
    entry(results, "lightning")
    ref = lc.reference()
    assert min(ref["norms"]) > lc.CLIP, ref["norms"]  # every step clipped
    ranks = [r["lightning"]["value"]["straight"] for r in results]
    mean = torch.tensor([ranks[0]["losses"], ranks[1]["losses"]]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, want in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][f"net.{name}"], want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_checkpoint_resumes_exactly(run):
    """One epoch, trainer.save_checkpoint, a new module of other values resumes from it: the
    second epoch's losses and the final parameters equal the straight run's, bit for bit."""
    results, converted = run
    entry(results, "lightning")
    for rank, r in enumerate(results):
        v = r["lightning"]["value"]
        half = lc.EPOCH_BATCHES
        assert v["first"]["losses"] == v["straight"]["losses"][:half], f"rank {rank}"
        assert v["resumed"]["losses"] == v["straight"]["losses"][half:], f"rank {rank}: resumed losses differ"
        for name, want in v["straight"]["params"].items():
            assert torch.equal(v["resumed"]["params"][name], want), f"rank {rank}: {name}"
    # The checkpoint is DCP in the original shapes: torch's converter reads it.
    assert converted["state_dict"]["net.emb.weight"].shape == (ic.VOCAB, ic.D)
    assert converted["optimizer_0"]["state"]["net.down.weight"]["exp_avg"].shape == (20, 33)
