"""What the rank workers and tests of tests/train share: the Gloo group, running named cases
on every rank (and the reference on rank 0), saving each rank's results, and comparing a sharded
run with its single-process reference."""
from __future__ import annotations

import datetime
import os
import traceback
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist


def init_group(rank: int, ws: int, store: str, backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=60), **kw)


def run_cases(rank: int, ws: int, store: str, out_dir: str,
              cases: Iterable[Tuple[str, Callable[[], Dict], Optional[Callable[[], Dict]]]],
              backend: str = "gloo") -> None:
    """cases: (name, the sharded run on every rank, its reference on rank 0 or None), each under
    a new process group (Gloo; "nccl": rank r on GPU r); the first error is recorded and ends the rest (the ranks would be out of
    step). The references run on rank 0 after the last case, outside any group. Writes
    out_dir/rank<r>.pt, as mp_harness.run_ranks reads it."""
    results: Dict = {}
    references = []  # (name, reference): rank 0's, run once every case is done
    try:
        for n, (name, run, reference) in enumerate(cases):
            results[name] = _one_case(rank, ws, f"{store}.{n}", backend, run)
            if "error" in results[name]:
                break
            if rank == 0 and reference is not None:
                references.append((name, reference))
        # Not between the cases: the other ranks would wait through a reference in the next
        # case's rendezvous, whose timeout (60 s) a cold Inductor compile of a compiled
        # reference can outlast on a loaded 2-core machine.
        for name, reference in references:
            try:
                results[name]["reference"] = reference()
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                break
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _one_case(rank: int, ws: int, store: str, backend: str, run: Callable[[], Dict]) -> Dict:
    """One case under a group of its own: {"value": what run returned}, or {"error": the traceback}
    when setting up the group, the case, or stopping the runtime and the group after it raised (a
    failure outside the case would otherwise end the rank with the case missing from its results)."""
    import dcplan

    try:
        init_group(rank, ws, store, backend)
        result = {"value": run()}
    except Exception:
        result = {"error": traceback.format_exc()}
    try:
        dcplan.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        if "error" not in result:
            result = {"error": "stopping the runtime or the group after the case:\n" + traceback.format_exc()}
    return result


def step(loss: torch.Tensor, opt, ws: int) -> float:
    """One optimizer step on loss (this rank's); returns the mean loss over the ranks."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / ws


def assert_trained_like(got: Dict, ref: Dict, loss_tol: Dict, param_tol: Dict) -> None:
    """Losses and final parameters (by name) of a sharded run against its reference."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **loss_tol)
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, **param_tol, msg=lambda m, n=name: f"{n}: {m}")
