"""What the multi-process suites (tests/python, tests/replay, tests/gpu) share: spawning one
process per rank, reading back what each rank saved, and checking a run against its reference."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.multiprocessing as mp

import dist_cases


def dcplan_binary() -> str:
    """The built dcplan CLI ($DCPLAN_BUILD_DIR/bin/dcplan); skips (with the reason) without one."""
    build = os.environ.get("DCPLAN_BUILD_DIR")
    path = os.path.join(build, "bin", "dcplan") if build else None
    if not path or not os.path.exists(path):
        pytest.skip("the dcplan CLI is not built (DCPLAN_BUILD_DIR/bin/dcplan)")
    return path


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@contextlib.contextmanager
def busy_processes(n: int):
    """n processes spinning on a core each while the block runs: the loaded machine of a CI run,
    where threads get preempted. Each also stops once this process is gone (a rank killed by its
    launcher never reaches the block's end)."""
    spin = f"import os\nwhile os.getppid() == {os.getpid()}:\n    pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def offload_floors(cli: str, trace, env=None) -> List[int]:
    """The floors `dcplan plan TRACE --memory-budget 1` is refused with, in bytes: what any plan
    needs with all optimizer state offloaded, then (ZeRO-3, eager) with every master shard too, and
    with every saved activation the trace recorded as movable too."""
    refused = os.path.join(os.path.dirname(str(trace)), "refused.plan.json")  # never written
    res = subprocess.run([cli, "plan", str(trace), "-o", refused, "--memory-budget", "1"], env=env,
                         capture_output=True, text=True)
    floors = re.findall(r"offloaded[^:]*: at least ([0-9.]+) (B|KiB|MiB|GiB)", res.stderr)
    assert res.returncode == 2 and floors, f"exit {res.returncode}: {res.stderr}"
    return [int(float(n) * _UNITS[u]) for n, u in floors]


@pytest.fixture(scope="session")
def dcplan_module():
    """The dcplan package; skips (with the reason) when its extension was not built."""
    try:
        import dcplan
    except ImportError as e:
        pytest.skip(f"dcplan extension not importable: {e}")
    return dcplan


def gpu_ranks() -> int:
    """How many GPUs the multi-GPU tests run on: $DCPLAN_TEST_GPUS, 2 (the default) or 4 (uneven
    shards and a ring of more than two): the cases' global batches (dist_cases' 12 rows, the
    compiled and graphed cases' 4) split over those."""
    raw = os.environ.get("DCPLAN_TEST_GPUS", "2")
    if raw not in ("2", "4"):
        raise ValueError(f"DCPLAN_TEST_GPUS: expected 2 or 4 GPUs (the test cases' batches split over those), "
                         f"got {raw!r}")
    return int(raw)


def require_gpus(dcplan, n: int = 2) -> None:
    """Skips (with the reason) unless this machine has n GPUs and dcplan was built with CUDA."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {have} (torch {torch.__version__})")
    if not dcplan._C.has_nccl():
        pytest.skip("dcplan._C was built without CUDA (build the cuda preset and set DCPLAN_BUILD_DIR)")


def selected_cases() -> Optional[List[str]]:
    """The case names in $DCPLAN_TEST_CASES (comma-separated), or None for all."""
    names = os.environ.get("DCPLAN_TEST_CASES")
    return names.split(",") if names else None


def skip_unselected(name: str) -> None:
    selected = selected_cases()
    if selected is not None and name not in selected:
        pytest.skip("not selected by DCPLAN_TEST_CASES")


def run_ranks(worker: Callable, ws: int, *args, label: str = "") -> List[Dict]:
    """Runs worker(rank, ws, init_file, out_dir, *args) in ws spawned processes and returns what
    each rank saved in out_dir/rank<r>.pt (on the CPU). A rank that raised or exited keeps the
    cases it finished; the tests name the rest. A rank killed by a signal fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(worker, args=(ws, os.path.join(tmp, "store"), tmp, *args), nprocs=ws, join=True,
                               start_method="spawn")
        except mp.ProcessRaisedException as e:
            print(e)  # the workers record their errors; they are reported per test
        except mp.ProcessExitedException as e:
            # Killed by a signal (an abort at exit, a crash): never a pass, whatever was saved.
            if e.signal_name is not None:
                pytest.fail(f"rank {e.error_index} of {ws}{label} died of {e.signal_name}: {e}")
            print(e)
        per_rank = []
        for r in range(ws):
            path = os.path.join(tmp, f"rank{r}.pt")
            assert os.path.exists(path), f"rank {r} of {ws}{label} wrote no results"
            per_rank.append(torch.load(path, weights_only=False, map_location="cpu"))
    return per_rank


def run_own_processes(target: Callable, ws: int, args: tuple, limit_s: float) -> List[mp.Process]:
    """Runs target(rank, *args) in ws spawned processes of our own and waits for all of them:
    mp.spawn would terminate the others as soon as one dies, and the fault tests watch what the
    others do then. is_alive() reaps the dead (a zombie still answers kill(pid, 0), so a peer
    would not see it exit). Fails, naming them, when ranks still run after limit_s (killed then)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(ws)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if hung:
        pytest.fail(f"ranks {hung} of {ws} still running after {limit_s:.0f} s")
    return procs


def entry(per_rank: List[Dict], name: str) -> Dict:
    """Rank 0's entry for name, once every rank ran it without error (else the test fails, naming the rank)."""
    for r, res in enumerate(per_rank):
        got = res.get(name)
        if got is None:
            pytest.fail(f"{name}: rank {r} did not run it (an earlier case failed)")
        if "error" in got:
            pytest.fail(f"{name} failed on rank {r}:\n{got['error']}")
    return per_rank[0][name]


def assert_reduced_grads(v: Dict, rank: int, ws: int) -> None:
    """The op checks' reductions (dist_cases.run_op_checks, gpu_worker.run_gpu_op_checks): rank r
    contributes r+1 per element; ZeRO-3 reduce-scatters the mean, ZeRO-1 before the boundary
    leaves the buffer alone (it still holds the ZeRO-3 result), at the boundary it all-reduces
    two micro-steps; inference all-reduces sum."""
    mean = sum(r + 1 for r in range(ws)) / ws
    for i, numel in {0: 5, 1: 9, 2: 1, 3: 14}.items():
        s = -(-numel // ws)
        valid = max(0, min(s, numel - rank * s))
        want = torch.zeros(s)
        want[:valid] = mean * (i + 1)
        torch.testing.assert_close(v["z3_grads"][i], want, msg=lambda m: f"rank {rank} z3 grad {i}: {m}")
        torch.testing.assert_close(v["z1_before_boundary"][i], want)
        want1 = torch.zeros(s)
        want1[:valid] = 2 * mean
        torch.testing.assert_close(v["z1_grads"][i], want1, msg=lambda m: f"rank {rank} z1 grad {i}: {m}")
    total = float(sum(r + 1 for r in range(ws)))
    torch.testing.assert_close(v["inference_all_reduce"], torch.full((4,), total))
    torch.testing.assert_close(v["inference_all_reduce_"], torch.full((2, 3), total))


def assert_matches_reference(case, got: Dict, ref: Dict, ws: int, steps: int, what: str,
                             loss_tol: Dict, param_tol: Dict) -> None:
    """A sharded run against its unsharded reference: losses, full parameters, shard sizes, and
    what stays gathered after forward (nothing in ZeRO-3, everything in ZeRO-1/2)."""
    assert len(got["losses"]) == steps
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **loss_tol,
                               msg=lambda m: f"{what} losses differ: {m}")
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, **param_tol,
                                   msg=lambda m, n=name: f"{what} parameter {n}: {m}")
    # dcplan.clip_grad_norm_ returns the unsharded model's total norm, every step (and clipped by it).
    torch.testing.assert_close(torch.tensor(got.get("norms", [])), torch.tensor(ref.get("norms", [])), **loss_tol,
                               msg=lambda m: f"{what} gradient norms differ: {m}")
    if case.variant == "clip":
        assert len(got["norms"]) == steps and min(ref["norms"]) > dist_cases.MAX_NORM, ref["norms"]  # every step clips
    # Every rank holds ceil(numel/ws) elements per parameter.
    expected = sorted(-(-v.numel() // ws) for v in ref["params"].values())
    assert sorted(s[0] for s in got["shard_shapes"]) == expected
    held = got["gathered_after_forward"]
    if case.stage == 3:
        assert set(held) == {0}, held
    else:
        assert set(held) == {got["num_params"]}, held
