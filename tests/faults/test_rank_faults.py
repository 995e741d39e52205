"""A rank that dies, stops answering or takes another branch mid-step: the others leave, in
bounded time, with an error naming the op, its graph and its place in the step; nothing hangs
(3 Gloo ranks)."""
import datetime
import os
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from mp_harness import run_own_processes  # noqa: E402

PG_TIMEOUT_S = 4  # the process group's timeout: how long a rank waits for one that stopped answering


def worker(rank, ws, store_file, out_dir, fault):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import dist_cases
    import dcplan

    torch.set_num_threads(1)
    # Only the faulty step runs under the short timeout: the ranks meet on a world group with a
    # generous one (on a loaded machine a rank may start seconds after another), and dcplan runs
    # on a group of the same ranks with PG_TIMEOUT_S.
    dist.init_process_group("gloo", store=dist.FileStore(store_file, ws), rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    model = dist_cases.make_model(dist_cases.Case("fault", 3))
    dcplan.shard(model, stage=3, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if rank == 1 and fault == "disagree":
        plain_forward = model.forward

        def forward(idx):  # rank-dependent control flow: at the second step, rank 1 skips the block
            if steps_done[0] == 1:
                return model.head(model.ln_f(model.embed(idx) + model.pos))
            return plain_forward(idx)

        model.forward = forward
    elif rank == 1:
        def misbehave(module, args):
            if steps_done[0] == 1:  # mid-forward of the second step
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3 * PG_TIMEOUT_S)  # stuck, then it finds the others gone

        model.block.register_forward_pre_hook(misbehave)
    steps_done = [0]
    result = {"error": None}
    start = time.monotonic()
    try:
        for _ in range(3):
            idx = torch.randint(0, 37, (2, dist_cases.SEQ))
            dist_cases.loss_fn(model, idx, idx).backward()
            opt.step()
            opt.zero_grad()
            steps_done[0] += 1
            if steps_done[0] == 1:
                dist.barrier()  # the faulty step starts together on every rank
    except RuntimeError:
        result = {"error": traceback.format_exc(limit=1), "seconds": time.monotonic() - start}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run(fault):
    """Runs 3 ranks to their end; returns {rank: result} of the ranks that wrote one, and exit codes."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = run_own_processes(worker, 3, (3, os.path.join(tmp, "store"), tmp, fault), limit_s=120)
        results = {}
        for r in range(3):
            path = os.path.join(tmp, f"rank{r}.pt")
            if os.path.exists(path):
                results[r] = torch.load(path, weights_only=False)
        return results, [p.exitcode for p in procs]


def check_survivor(result, rank, limit_s):
    assert result["error"] is not None, f"rank {rank} should have failed"
    msg = result["error"]
    assert f"rank {rank}: " in msg and " in graph 0, op " in msg and " of the forward of step 1: a collective failed" in msg, msg
    assert result["seconds"] < limit_s, f"rank {rank} took {result['seconds']:.1f} s"


def test_a_killed_rank_ends_the_others_at_once_with_the_op_named():
    results, codes = run("kill")
    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 0 and codes[2] == 0, f"the survivors exit cleanly after the error, got {codes}"
    for r in (0, 2):
        check_survivor(results[r], r, limit_s=15)  # at once (well under the process group's timeout)


def test_a_stuck_rank_ends_the_others_after_the_process_group_timeout():
    results, codes = run("stuck")
    assert codes == [0, 0, 0], codes
    for r in (0, 2):
        check_survivor(results[r], r, limit_s=PG_TIMEOUT_S + 10)
        assert f"{PG_TIMEOUT_S * 1000}ms" in results[r]["error"], results[r]["error"]
    # The stuck rank, when it wakes, finds the others gone: an error too, not a hang.
    assert results[1]["error"] is not None and "a collective failed" in results[1]["error"]


def test_ranks_that_take_different_branches_fail_together_naming_both_ops():
    results, codes = run("disagree")
    assert codes == [0, 0, 0], codes
    for r in range(3):
        msg = results[r]["error"]
        assert msg is not None, f"rank {r} should have failed"
        assert f"rank {r}: allgather_param of id " in msg and "op 12 of the forward of step 1" in msg, msg
        assert "the ranks disagree on the next collective" in msg, msg
        # Its own op and another rank's: rank 1 gathers the head (id 15), the others the block's first norm (id 4).
        assert "for allgather_param of id 4 in graph 0" in msg and "for allgather_param of id 15 in graph 0" in msg, msg
        assert results[r]["seconds"] < 30
