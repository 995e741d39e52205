"""The host-memory check of a plan's offload (dcplan._host_memory): the ranks on a host together
against what it has available, before step 0. The refusal on a real run is in
tests/replay/test_plan_offload.py."""
import pytest
import torch

from dcplan import _host_memory

MIB = 2**20
PLAN = "/plans/offload.json"


def test_ranks_that_together_need_more_than_is_available_are_refused_with_both_amounts():
    with pytest.raises(MemoryError) as e:
        _host_memory.check(PLAN, 300 * MIB, torch.device("cuda", 0), found=(1000 * MIB, "MemAvailable in x"),
                           ranks=(4, "LOCAL_WORLD_SIZE"))
    text = str(e.value)
    for part in (PLAN, "300.0 MiB", "pinned host memory", "4 rank(s)", "(LOCAL_WORLD_SIZE)", "1.17 GiB needed",
                 "1000.0 MiB available (MemAvailable in x)", "--memory-budget"):
        assert part in text, (part, text)


def test_cpu_ranks_need_host_memory_not_pinned():
    with pytest.raises(MemoryError, match=r"in host memory on each rank"):
        _host_memory.check(PLAN, 2 * MIB, torch.device("cpu"), found=(MIB, "src"), ranks=(1, "one"))


@pytest.mark.parametrize("per_rank, have", [(250 * MIB, 1000 * MIB), (0, 0)], ids=["exactly-fits", "no-offload"])
def test_what_fits_passes(per_rank, have):
    _host_memory.check(PLAN, per_rank, torch.device("cpu"), found=(have, "src"), ranks=(4, "n"))


def test_ranks_on_host_is_torchruns_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert _host_memory.ranks_on_host() == (8, "LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _host_memory.ranks_on_host()[0] == 1


def test_available_reads_the_kernel_or_the_container(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    4000000 kB\n")
    monkeypatch.setattr(_host_memory, "MEMINFO", str(meminfo))
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(_host_memory, "CGROUP_LIMITS", ((str(limit), str(usage)),))
    limit.write_text("max\n")  # no limit: the kernel's figure
    usage.write_text("1000\n")
    assert _host_memory.available() == (4000000 * 1024, f"MemAvailable in {meminfo}")
    limit.write_text(f"{3 * 2**30}\n")  # a container's limit under it
    usage.write_text(f"{2**30}\n")
    have, source = _host_memory.available()
    assert have == 2 * 2**30 and str(limit) in source


def test_this_host_reports_some_memory():
    found = _host_memory.available()
    assert found is not None and found[0] > 0, found
