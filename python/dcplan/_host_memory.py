"""Whether this host has the memory a plan's offload keeps there (docs/planning.md, "Offload").

A plan that keeps optimizer state or master shards on the host needs that memory on every rank
(pinned on a GPU). It is checked when the plan is loaded, before any of it is allocated and
before step 0, so that a host without enough fails with the bytes needed and available rather
than at an allocation in the middle of a step. The check counts the plan's bytes: on a GPU torch's
pinned allocator may round a buffer up, and on CPU ranks the device's own memory is host memory
too, so it is a lower bound there.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")

# Where the host memory still available is read: the kernel's estimate, then this process's
# memory cgroup and its ancestors, each limit less its usage (page cache that can be dropped left
# out), where that is less.
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_V1_MEMORY = "/sys/fs/cgroup/memory"
CGROUP_V2 = "/sys/fs/cgroup"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdecimal() else None  # cgroup v2 writes "max" for no limit


def _stat(path: str, key: str) -> int:
    """A counter of a cgroup's memory.stat (0 where absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdecimal():
                    return int(value)
    except OSError:
        pass
    return 0


def _memory_cgroups() -> Tuple[List[str], Tuple[str, str, str]]:
    """The directories of this process's memory cgroup and of each ancestor mounted here (itself
    first), and the files read in each: its limit, its usage and the reclaimable page cache's key in
    memory.stat; the v1 memory controller's, else v2's."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return [], ("", "", "")
    found = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if "memory" in controllers.split(","):
            found = (CGROUP_V1_MEMORY, path, ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
            break
        if hierarchy == "0" and not controllers:
            found = (CGROUP_V2, path, ("memory.max", "memory.current", "inactive_file"))
    if found is None:
        return [], ("", "", "")
    root, path, files = found
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(root, *parts[:k]) for k in range(len(parts), -1, -1)]  # the mount's root last
    return [d for d in dirs if os.path.isdir(d)], files


def available() -> Optional[Tuple[int, str]]:
    """The host memory this process may still take, in bytes, and where that was read; None where
    neither the kernel nor a cgroup says (not Linux)."""
    found = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found = (int(line.split()[1]) * 1024, f"MemAvailable in {MEMINFO}")
    except OSError:
        pass
    dirs, (limit_file, usage_file, cache) = _memory_cgroups()
    for d in dirs:
        limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
        if limit is None or usage is None:
            continue
        left = max(0, limit - max(0, usage - _stat(os.path.join(d, "memory.stat"), cache)))
        if found is None or left < found[0]:
            found = (left, f"the memory cgroup {d}: {limit_file} less {usage_file} and {cache}")
    return found


def ranks_on_host() -> Tuple[int, str]:
    """How many ranks of the job share this host, and where that was read: torchrun's
    LOCAL_WORLD_SIZE, 1 without it."""
    value = os.environ.get(ENV_LOCAL_WORLD_SIZE)
    if value is None:
        return 1, f"${ENV_LOCAL_WORLD_SIZE} unset: this rank alone"
    if not value.strip().isdecimal() or int(value) < 1:
        raise ValueError(f"dcplan.shard: ${ENV_LOCAL_WORLD_SIZE} (the ranks on this host) should be an integer "
                         f">= 1, got '{value}'")
    return int(value), f"${ENV_LOCAL_WORLD_SIZE}"


def size(b: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def _what(state: int, masters: int, activations: int) -> str:
    """The parts of a plan's host memory, said."""
    parts = [f"optimizer state {size(state)}"] if state else []
    parts += [f"master shards {size(masters)}"] if masters else []
    parts += [f"saved activations {size(activations)}"] if activations else []
    return ", ".join(parts)


def shortfall(plan_path: str, state: int, masters: int, device: torch.device, found: Optional[Tuple[int, str]],
              ranks: Tuple[int, str], activations: int = 0, activations_field: str = "") -> Optional[str]:
    """What this host lacks for the plan's offload, said, or None: state, masters and activations,
    the plan's bytes a rank keeps on the host (activations_field: the plan's field of those);
    found and ranks, available() and ranks_on_host()."""
    per_rank = state + masters + activations
    if per_rank <= 0 or found is None:
        return None  # nothing offloaded, or nothing says how much there is: the allocations will
    count, counted_by = ranks
    have, source = found
    if per_rank * count <= have:
        return None
    kind = "pinned host memory" if device.type == "cuda" else "host memory"
    what = _what(state, masters, activations)
    field = _field(state, masters, activations_field)
    return (f"{plan_path}: {field}: the plan keeps {size(per_rank)} in {kind} on each rank "
            f"({what}) and {count} rank(s) run on this host ({counted_by}): {size(per_rank * count)} needed, "
            f"{size(have)} available ({source}). Plan with a larger --memory-budget, which offloads less, or "
            "run fewer ranks on this host")


def _agree(mine: Optional[str], others: str, device: torch.device, group) -> None:
    """Raises MemoryError on every rank of group where one rank has a complaint (mine: this rank's,
    or None): that rank with its own, the others with `others`. A collective, so that no rank
    refuses while the others wait for it at their next one."""
    import torch.distributed as dist

    short = torch.tensor([int(mine is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(short, op=dist.ReduceOp.MAX, group=group)
    if mine is not None:
        raise MemoryError(f"dcplan.shard: {mine}")
    if int(short.item()):
        raise MemoryError(f"dcplan.shard: {others}")


def _field(state: int, masters: int, activations_field: str) -> str:
    """The plan's field a message names: the optimizer state's where it offloads any, else the saved
    activations' (activations_field)."""
    return "/offload/optimizer_state" if state + masters > 0 else activations_field


def check(plan_path: str, state: int, masters: int, device: torch.device, group, activations: int = 0,
          activations_field: str = "") -> None:
    """Raises MemoryError on every rank of group (a collective: each rank reaches it as it loads the
    plan) where the host of one of them lacks the memory the plan's offload keeps there; before any
    of it is allocated, so that no rank's allocations hide from another's reading."""
    if state + masters + activations <= 0:
        return  # every rank loads the same plan: none takes part
    mine = shortfall(plan_path, state, masters, device, available(), ranks_on_host(), activations, activations_field)
    field = _field(state, masters, activations_field)
    _agree(mine, f"{plan_path}: {field}: another rank's host lacks the memory the plan's offload "
           "keeps there (its error says how much)", device, group)


def allocate(plan_path: str, state: int, masters: int, device: torch.device, group, make: Callable[[], T],
             activations: int = 0, activations_field: str = "") -> T:
    """make()'s result: the plan's host memory (state bytes for the optimizer state, their
    alignment included, masters for the master shards and activations for the saved activations on
    this rank), allocated on every rank of group or refused on all (MemoryError; a collective, as
    check()): a host that had the memory by check() may still not give it (pinned memory counts
    against the locked-memory limit; torch's pinned allocator rounds each block up to a power of two)."""
    if state + masters + activations <= 0:
        return make()
    mine = None
    field = _field(state, masters, activations_field)
    try:
        made = make()
    except (RuntimeError, MemoryError) as e:  # torch's pinned allocator, numpy's
        made = None
        kind = "pinned host memory" if device.type == "cuda" else "host memory"
        what = _what(state, masters, activations)
        mine = (f"{plan_path}: {field}: this rank could not allocate the "
                f"{size(state + masters + activations)} of "
                f"{kind} the plan's offload keeps there ({what}; {type(e).__name__}: {e}). Plan with a larger "
                "--memory-budget, which offloads less, or run fewer ranks on this host")
    _agree(mine, f"{plan_path}: {field}: another rank could not allocate the host memory the plan's "
           "offload keeps there (its error says why)", device, group)
    return made
