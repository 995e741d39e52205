"""The host-memory check of a plan's offload (dcplan._host_memory): the ranks on a host together
against what it has available, before step 0. The refusal of a real run, on every rank, is in
tests/replay/test_plan_offload.py."""
import os

import pytest
import torch
from mp_harness import run_ranks

from dcplan import _host_memory

MIB = 2**20
PLAN = "/plans/offload.json"


def test_ranks_that_together_need_more_than_is_available_are_refused_with_both_amounts():
    said = _host_memory.shortfall(PLAN, 200 * MIB, 100 * MIB, torch.device("cuda", 0),
                                  found=(1000 * MIB, "MemAvailable in x"), ranks=(4, "$LOCAL_WORLD_SIZE"))
    assert said == (f"{PLAN}: /offload/optimizer_state: the plan keeps 300.00 MiB in pinned host memory on each rank "
                    "(optimizer state 200.00 MiB, master shards 100.00 MiB) and 4 rank(s) run on this host "
                    "($LOCAL_WORLD_SIZE): 1.17 GiB needed, 1000.00 MiB available (MemAvailable in x). Plan with a "
                    "larger --memory-budget, which offloads less, or run fewer ranks on this host"), said


def test_cpu_ranks_need_host_memory_and_state_alone_says_so():
    said = _host_memory.shortfall(PLAN, 2 * MIB, 0, torch.device("cpu"), found=(1536, "src"), ranks=(1, "one"))
    assert "2.00 MiB in host memory on each rank (optimizer state 2.00 MiB) and" in said, said
    assert "1.50 KiB available (src)" in said, said


@pytest.mark.parametrize("state, masters, have", [(150 * MIB, 100 * MIB, 1000 * MIB), (0, 0, 0)],
                         ids=["exactly-fits", "no-offload"])
def test_what_fits_passes(state, masters, have):
    assert _host_memory.shortfall(PLAN, state, masters, torch.device("cpu"), found=(have, "src"), ranks=(4, "n")) \
        is None


def test_ranks_on_host_is_torchruns_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _host_memory.ranks_on_host() == (8, "$LOCAL_WORLD_SIZE")
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=rf"\$LOCAL_WORLD_SIZE \(the ranks on this host\) should be an integer "
                                             rf">= 1, got '{bad}'"):
            _host_memory.ranks_on_host()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _host_memory.ranks_on_host()[0] == 1


def test_available_reads_the_kernel_then_the_process_memory_cgroup_and_its_ancestors(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    4000000 kB\n")
    monkeypatch.setattr(_host_memory, "MEMINFO", str(meminfo))
    proc = tmp_path / "cgroup"
    proc.write_text("5:devices:/\n4:memory:/jobs/job7\n0::/\n")
    monkeypatch.setattr(_host_memory, "PROC_CGROUP", str(proc))
    root = tmp_path / "memory"
    monkeypatch.setattr(_host_memory, "CGROUP_V1_MEMORY", str(root))
    job, parent = root / "jobs" / "job7", root / "jobs"
    job.mkdir(parents=True)
    for d, limit, usage in ((job, 9223372036854771712, 5 * 2**30), (parent, 64 * 2**30, 2 * 2**30)):
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    assert _host_memory.available() == (4000000 * 1024, f"MemAvailable in {meminfo}")  # no limit under it
    (parent / "memory.stat").write_text(f"cache 99\ntotal_inactive_file {2**29}\n")  # droppable page cache
    (parent / "memory.limit_in_bytes").write_text(f"{2 * 2**30}\n")  # an ancestor's limit under it
    have, source = _host_memory.available()
    assert have == 2**29 and str(parent) in source and "total_inactive_file" in source, (have, source)


def test_a_cgroup_v2_limit_of_max_is_no_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(_host_memory, "MEMINFO", str(tmp_path / "absent"))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice\n")
    monkeypatch.setattr(_host_memory, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(_host_memory, "CGROUP_V2", str(tmp_path))
    (tmp_path / "user.slice").mkdir()
    (tmp_path / "user.slice" / "memory.max").write_text("max\n")
    (tmp_path / "user.slice" / "memory.current").write_text("1000\n")
    assert _host_memory.available() is None
    (tmp_path / "user.slice" / "memory.max").write_text(f"{3000}\n")
    assert _host_memory.available()[0] == 2000


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_this_host_reports_some_memory():
    found = _host_memory.available()
    assert found is not None and found[0] > 0, found


def _allocating_rank(rank, ws, init_file, out_dir):
    """Rank 1's allocation fails, then both succeed: what each rank was told, and what it got."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)

    def make():
        if rank == 1:
            raise MemoryError("Unable to allocate 3.00 MiB")
        return "pools"

    try:
        said = f"returned {_host_memory.allocate(PLAN, 3 * MIB, MIB, torch.device('cpu'), None, make)}"
    except MemoryError as e:
        said = str(e)
    got = _host_memory.allocate(PLAN, 3 * MIB, MIB, torch.device("cpu"), None, lambda: "pools")
    torch.save({"said": said, "got": got}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_an_allocation_that_fails_on_one_rank_is_refused_on_every_rank():
    """The host memory of a plan's offload is allocated when the plan is loaded: where one rank's
    host does not give it, every rank raises (none waits for it at its next collective), that one
    saying what failed."""
    ranks = run_ranks(_allocating_rank, 2)
    assert ranks[1]["said"] == (f"dcplan.shard: {PLAN}: /offload/optimizer_state: this rank could not allocate the "
                                "4.00 MiB of host memory the plan's offload keeps there (optimizer state 3.00 MiB, "
                                "master shards 1.00 MiB; MemoryError: Unable to allocate 3.00 MiB). Plan with a "
                                "larger --memory-budget, which offloads less, or run fewer ranks on this host")
    assert ranks[0]["said"] == (f"dcplan.shard: {PLAN}: /offload/optimizer_state: another rank could not allocate "
                                "the host memory the plan's offload keeps there (its error says why)")
    assert [r["got"] for r in ranks] == ["pools", "pools"]
