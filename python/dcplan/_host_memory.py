"""Whether this host has the memory a plan's offload keeps there (docs/planning.md, "Offload").

A plan that keeps optimizer state or master shards on the host needs that memory on every rank
(pinned on a GPU). It is checked when the plan is loaded, before any of it is allocated and
before step 0, so that a host without enough fails with the bytes needed and available rather
than at an allocation in the middle of a step.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

# Where the host memory still available is read: the kernel's estimate, then a container's limit
# less its usage where that is less (cgroup v2, then v1).
MEMINFO = "/proc/meminfo"
CGROUP_LIMITS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available() -> Optional[Tuple[int, str]]:
    """The host memory this process may still take, in bytes, and where that was read; None where
    neither the kernel nor a container says (not Linux)."""
    found = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, f"MemAvailable in {MEMINFO}")
    except OSError:
        pass
    for limit_path, usage_path in CGROUP_LIMITS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None:
            left = max(0, limit - usage)
            if found is None or left < found[0]:
                found = (left, f"the container's limit less its usage, {limit_path} and {usage_path}")
            break
    return found


def ranks_on_host() -> Tuple[int, str]:
    """How many ranks of the job share this host, and where that was read (torchrun's
    LOCAL_WORLD_SIZE; 1 without it)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is not None and value.isdigit() and int(value) > 0:
        return int(value), "LOCAL_WORLD_SIZE"
    return 1, "LOCAL_WORLD_SIZE unset: this rank alone"


def _size(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def check(plan_path: str, per_rank: int, device: torch.device, found: Optional[Tuple[int, str]] = None,
          ranks: Optional[Tuple[int, str]] = None) -> None:
    """Raises MemoryError where the ranks on this host together need more host memory for the
    plan's offload (per_rank bytes each: the plan's optimizer state and master shard bytes) than
    is available. found and ranks: available() and ranks_on_host(), read here unless given."""
    if per_rank <= 0:
        return
    found = available() if found is None else found
    if found is None:
        return  # nothing says how much there is: the allocations will
    count, counted_by = ranks_on_host() if ranks is None else ranks
    have, source = found
    if per_rank * count <= have:
        return
    kind = "pinned host memory" if device.type == "cuda" else "host memory"
    raise MemoryError(
        f"dcplan.shard: plan {plan_path} keeps {_size(per_rank)} of optimizer state and master shards in "
        f"{kind} on each rank, and {count} rank(s) run on this host ({counted_by}): {_size(per_rank * count)} "
        f"needed, {_size(have)} available ({source}). Plan with a larger --memory-budget, which offloads "
        "less, or run fewer ranks on this host")
