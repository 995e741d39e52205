"""A rank that dies mid-step on 2 GPUs: the other leaves within DCPLAN_NCCL_TIMEOUT, with an error
naming the op, and exits cleanly; dcplan's NCCL communicator is aborted, nothing hangs."""
import os
import signal
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from mp_harness import run_own_processes

pytestmark = pytest.mark.gpu

TIMEOUT_S = 10


def worker(rank, ws, store_file, out_dir):
    import dist_cases
    import dcplan

    os.environ["DCPLAN_NCCL_TIMEOUT"] = str(TIMEOUT_S)
    torch.cuda.set_device(rank)
    dist_cases.DEVICE = torch.device("cuda", rank)
    # The process group only brings dcplan's NCCL communicator up (its unique id): Gloo.
    dist.init_process_group("gloo", store=dist.FileStore(store_file, ws), rank=rank, world_size=ws)
    model = dist_cases.make_model(dist_cases.Case("gpu-fault", 3))
    dcplan.shard(model, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps_done = [0]
    if rank == 1:
        def die(module, args):
            if steps_done[0] == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        model.block.register_forward_pre_hook(die)
    result = {"error": None}
    start = time.monotonic()
    try:
        for _ in range(4):
            idx = torch.randint(0, 37, (2, dist_cases.SEQ))
            loss = dist_cases.loss_fn(model, idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()  # the host waits for the step, as a training loop that logs does
            steps_done[0] += 1
    except RuntimeError:
        result = {"error": traceback.format_exc(limit=1), "seconds": time.monotonic() - start}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_killed_gpu_rank_aborts_the_communicator_of_the_other(gpu_dcplan):
    with tempfile.TemporaryDirectory() as tmp:
        procs = run_own_processes(worker, 2, (2, os.path.join(tmp, "store"), tmp), limit_s=180)
        codes = [p.exitcode for p in procs]
        assert codes[1] == -signal.SIGKILL, codes
        assert codes[0] == 0, f"rank 0 should exit cleanly after its error, got {codes}"
        res = torch.load(os.path.join(tmp, "rank0.pt"), weights_only=False)
    msg = res["error"]
    assert msg is not None, "rank 0 should fail when rank 1 dies"
    assert "rank 0: " in msg and "a collective failed" in msg, msg
    assert f"did not complete within {TIMEOUT_S} s (DCPLAN_NCCL_TIMEOUT)" in msg, msg
    assert "dcplan aborted its NCCL communicator" in msg, msg
    assert res["seconds"] < TIMEOUT_S + 60, res["seconds"]
