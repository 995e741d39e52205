"""Worker of the GPU tests: one process per GPU, NCCL process group, dcplan on its NCCL transport.

Runs the op checks below, then every case of tests/python/dist_cases.py with the models and
data on the rank's GPU; rank 0 also trains the single-GPU reference. Results go to CPU
tensors in out_dir/rank<r>.pt.
"""
from __future__ import annotations

import datetime
import math
import os
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import dist_cases

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued ahead of the ops under test


def to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def run_gpu_op_checks(rank: int, ws: int, device: torch.device) -> Dict:
    """Direct op calls on the GPU with rank-dependent data; returns what each op produced."""
    import dcplan

    C = dcplan._C
    dcplan._shard._init_runtime(dist.group.WORLD, device, 64)
    out: Dict = {"backend": None}
    shapes = {0: [5], 1: [3, 3], 2: [1], 3: [2, 7]}
    shards, grads = {}, {}
    for i, shape in shapes.items():
        numel = math.prod(shape)
        s = -(-numel // ws)
        full = torch.arange(numel, dtype=torch.float32, device=device) + 100 * i
        shard = torch.zeros(s, device=device)
        lo, hi = min(rank * s, numel), min(rank * s + s, numel)
        shard[: hi - lo] = full[lo:hi]
        shards[i], grads[i] = shard, torch.zeros(s, device=device)
        C.register_param(i, shape, shard, grads[i], False)
    C.register_graph_z3(0, [0, 1, 2, 3])
    C.register_graph_z1(1, [0, 1, 2, 3])
    ops = torch.ops.dc
    out["allgather"] = ops.wait_allgather(ops.allgather_param(shards[1], 0, 1), 0, 1).clone()
    out["allgather_bf16"] = ops.wait_allgather(ops.allgather_param(shards[3], 0, 3, torch.bfloat16), 0, 3).clone()
    token = torch.empty(0, device=device)
    ops.release_param(token, 0, 1, 1)
    ops.release_param(token, 0, 3, 1)
    out["held_after_release"] = C.gathered_param_ids()
    ops.prefetch_params_fused(0, [shards[0], shards[2], shards[3]], [0, 2, 3], [torch.float32] * 3)
    out["held_after_prefetch"] = C.gathered_param_ids()
    out["fused"] = [ops.wait_allgather(ops.allgather_param(shards[i], 0, i), 0, i).clone() for i in (0, 2, 3)]
    C.clear_all_gathered_params()

    # The host does not block: with ~0.1 s of GPU work queued, a gather + wait, a reduction
    # and end_backward return while the stream is still busy, and still see the data the
    # stream writes after the sleep (the side streams wait for the caller's stream).
    def reduce_all():
        C.start_backward(True, True)
        for i, shape in shapes.items():
            ops.reduce_grad(torch.full(shape, float(rank + 1), device=device) * (i + 1), 0, i)
        ops.end_backward(0)

    # NCCL connects lazily at the first collective of each kind (NCCL_RUNTIME_CONNECT), which
    # waits for the device; that one-time cost is not what is measured here.
    reduce_all()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(SLEEP_CYCLES)
    shards[1].add_(1000.0)  # queued behind the sleep
    times = {}
    t0 = time.perf_counter()
    g = ops.wait_allgather(ops.allgather_param(shards[1], 0, 1), 0, 1)
    after = g.clone()
    times["gather+wait"] = time.perf_counter() - t0
    reduce_all()
    times["reduce+end_backward"] = time.perf_counter() - t0 - times["gather+wait"]
    out["host_seconds_while_busy"] = time.perf_counter() - t0
    out["host_seconds_by_op"] = times
    out["stream_busy_after_ops"] = not stream.query()
    torch.cuda.synchronize()
    out["allgather_after_write"] = after
    shards[1].sub_(1000.0)
    ops.release_param(token, 0, 1, 1)
    out["z3_grads"] = {i: grads[i].clone() for i in shapes}
    # ZeRO-1: two micro-steps, reduced only at the boundary, accumulating.
    C.start_backward(True, False)
    for i, shape in shapes.items():
        ops.reduce_grad(torch.full(shape, float(rank + 1), device=device), 1, i)
    ops.end_backward(1)
    out["z1_before_boundary"] = {i: grads[i].clone() for i in shapes}
    C.start_backward(True, True)
    for i, shape in shapes.items():
        ops.reduce_grad(torch.full(shape, float(rank + 1), device=device), 1, i)
    ops.end_backward(1)
    out["z1_grads"] = {i: grads[i].clone() for i in shapes}
    x = torch.full((4,), float(rank + 1), device=device)
    out["inference_all_reduce"] = ops.inference_all_reduce(x)
    y = torch.full((3, 2), float(rank + 1), device=device).t()  # not contiguous
    ops.inference_all_reduce_(y)
    out["inference_all_reduce_"] = y.clone()
    # Offload to pinned memory on the offload stream, reload on the reload stream.
    a = torch.randn(1000, 33, device=device, generator=torch.Generator(device).manual_seed(rank))
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    a.mul_(2.0)  # queued behind the sleep: the offload must see it
    host = ops.offload_tensor(a, 0, 7)
    out["offload_pinned"] = host.is_pinned()
    host = ops.wait_offload(host, 0, 7)
    back = ops.wait_reload(ops.reload_tensor(host, 0, 7), 0, 7)
    out["offload_expected"] = a
    out["offload_host"] = host
    out["reload"] = back
    out["reload_device"] = str(back.device)
    C.cleanup()
    return to_cpu(out)


def worker(rank: int, ws: int, init_file: str, out_dir: str, case_names: Optional[List[str]]) -> None:
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist_cases.DEVICE = device
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=120), device_id=device)
    import dcplan

    results: Dict[str, Dict] = {}
    try:
        try:
            results["ops"] = {"value": run_gpu_op_checks(rank, ws, device)}
        except Exception:
            results["ops"] = {"error": traceback.format_exc()}
            raise
        finally:
            dcplan.shutdown()
        dist_cases.run_cases(rank, ws, case_names, results, convert=to_cpu)
    except Exception:
        pass
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
