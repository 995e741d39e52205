"""torch.ops.dc.inference_all_reduce(_) through shared memory on local CPU ranks: sums against a
reference, bits across ranks, the process-group fallback, errors, leaks, torch.compile."""
from __future__ import annotations

import os
import signal
import tempfile
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from mp_harness import run_own_processes, run_ranks

pytestmark = pytest.mark.multiprocess

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Around the vector width, the whole-chunk limit (16 KiB) and the 1 MiB chunk; none a multiple.
NUMELS = (0, 1, 37, 4099, 8197, (1 << 18) + 3, 3 * (1 << 19) + 5)


def inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g).mul_(100).to(dtype)


def reference(ws: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank 0 + rank 1 + ... in fp32, rounded once: what the op promises, bit for bit."""
    acc = inputs(0, numel, dtype).float()
    for r in range(1, ws):
        acc = acc + inputs(r, numel, dtype).float()
    return acc.to(dtype)


def _start(rank: int, ws: int, store_file: str, env: dict):
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_file, ws), rank=rank, world_size=ws)
    import dcplan

    return dcplan


def _save(out_dir: str, rank: int, out: dict) -> None:
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(out: dict, name: str, fn) -> None:
    try:
        out[name] = {"value": fn()}
    except Exception:
        out[name] = {"error": traceback.format_exc()}


def _error_of(fn) -> dict:
    """The RuntimeError fn raises, and how long it took to come ({"message": None}: none)."""
    start = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        return {"message": str(e), "seconds": time.monotonic() - start}
    return {"message": None}


def sums_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    out = {}
    ops = torch.ops.dc

    def init():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcplan.init()
        return {"path": dcplan._C.local_all_reduce_path(), "listing": os.listdir(env["DCPLAN_SHM_DIR"]),
                "warnings": [str(w.message) for w in caught]}

    _run(out, "init", init)

    def sums():
        res = {}
        for dtype in DTYPES:
            for numel in NUMELS:
                x = inputs(rank, numel, dtype)
                y = ops.inference_all_reduce(x)
                z = x.clone()
                assert ops.inference_all_reduce_(z) is z
                again = ops.inference_all_reduce(x)  # repeated runs give the same bits
                res[(str(dtype), numel)] = {"out": y, "in_place": z, "again": again, "input_kept": torch.equal(x, inputs(rank, numel, dtype))}
        # Not contiguous: a transposed view, reduced in place through a contiguous copy.
        t = inputs(rank, 12, torch.float32).view(3, 4).t()
        ops.inference_all_reduce_(t)
        res["transposed"] = t.clone()
        # float64 is not a shared-memory dtype: it goes through the process group.
        res["float64"] = ops.inference_all_reduce(torch.full((5,), float(rank + 1), dtype=torch.float64))
        return res

    _run(out, "sums", sums)
    _save(out_dir, rank, out)
    dcplan.shutdown()
    dist.destroy_process_group()


@pytest.fixture
def shm_dir():
    """A private segment directory on /dev/shm (a tmpfs), checked empty after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="dcplan-test-", dir=base) as d:
        yield d
        assert os.listdir(d) == [], f"segments left behind in {d}: {os.listdir(d)}"


@pytest.mark.parametrize("ws", [2, 3])
def test_sums_equal_the_reference_bit_for_bit_on_every_rank(dcplan_module, shm_dir, ws):
    per_rank = run_ranks(sums_worker, ws, {"DCPLAN_SHM_DIR": shm_dir})
    for r, res in enumerate(per_rank):
        assert "error" not in res["init"], res["init"]["error"]
        init = res["init"]["value"]
        assert init["path"].startswith(shm_dir + "/dcplan-"), init
        assert init["listing"] == [], "the segment's name should be gone once every rank mapped it"
        assert init["warnings"] == []
        assert "error" not in res["sums"], f"rank {r}:\n{res['sums']['error']}"
    results = [res["sums"]["value"] for res in per_rank]
    for dtype in DTYPES:
        for numel in NUMELS:
            want = reference(ws, numel, dtype)
            for r, res in enumerate(results):
                got = res[(str(dtype), numel)]
                for kind in ("out", "in_place", "again"):
                    assert got[kind].dtype == dtype and got[kind].shape == (numel,)
                    assert torch.equal(got[kind], want), f"{dtype} numel {numel} rank {r} {kind}"
                assert got["input_kept"], f"{dtype} numel {numel} rank {r}: out-of-place changed its input"
    want_t = sum(inputs(r, 12, torch.float32).view(3, 4).t() for r in range(ws))
    for r, res in enumerate(results):
        torch.testing.assert_close(res["transposed"], want_t, rtol=1e-6, atol=1e-4)
        assert torch.equal(res["float64"], torch.full((5,), float(sum(range(1, ws + 1))), dtype=torch.float64))


def compile_and_mismatch_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    dcplan.init()
    ops = torch.ops.dc
    out = {}

    def compiled():
        def f(x):
            y = ops.inference_all_reduce(x * 2) + 1
            z = x.clone()
            ops.inference_all_reduce_(z)
            return y, z

        x = inputs(rank, 1000, torch.float32)
        eager = f(x)
        graph = torch.compile(f, fullgraph=True, backend="inductor")(x)
        return {"eager": eager, "compiled": graph}

    _run(out, "compile", compiled)

    _run(out, "mismatch", lambda: _error_of(lambda: ops.inference_all_reduce_(torch.ones(10 + rank))))
    _save(out_dir, rank, out)
    dcplan.shutdown()
    dist.destroy_process_group()


def test_compile_fullgraph_and_ranks_that_disagree(dcplan_module, shm_dir):
    per_rank = run_ranks(compile_and_mismatch_worker, 2, {"DCPLAN_SHM_DIR": shm_dir, "DCPLAN_SHM_TIMEOUT": "60"})
    for r, res in enumerate(per_rank):
        assert "error" not in res["compile"], f"rank {r}:\n{res['compile']['error']}"
        v = res["compile"]["value"]
        for e, c in zip(v["eager"], v["compiled"]):
            assert torch.equal(e, c), f"rank {r}: compiled differs from eager"
        m = res["mismatch"]["value"]
        assert m["message"] is not None, f"rank {r}: sizes 10 and 11 should not reduce"
        assert "inference_all_reduce_: the ranks disagree" in m["message"], m["message"]
        assert "reduces 10 float32 elements" in m["message"] and "reduces 11 float32 elements" in m["message"]
        assert m["seconds"] < 10, "a disagreement is found at once, not at the timeout"


def fallback_worker(rank, ws, store_file, out_dir, env):
    # Each rank its own directory: they cannot share segments, as on two hosts.
    env = dict(env, DCPLAN_SHM_DIR=os.path.join(env["DCPLAN_SHM_DIR"], f"rank{rank}"))
    os.makedirs(env["DCPLAN_SHM_DIR"])
    dcplan = _start(rank, ws, store_file, env)
    out = {}

    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcplan.init()
        y = torch.ops.dc.inference_all_reduce(torch.full((7,), float(rank + 1)))
        return {"warnings": [(w.category.__name__, str(w.message)) for w in caught], "path": dcplan._C.local_all_reduce_path(), "sum": y}

    _run(out, "fallback", run)
    _save(out_dir, rank, out)
    dcplan.shutdown()
    os.rmdir(env["DCPLAN_SHM_DIR"])
    dist.destroy_process_group()


def test_ranks_without_common_shared_memory_fall_back_to_the_process_group_with_a_reason(dcplan_module, shm_dir):
    per_rank = run_ranks(fallback_worker, 2, {"DCPLAN_SHM_DIR": shm_dir})
    for r, res in enumerate(per_rank):
        assert "error" not in res["fallback"], res["fallback"]["error"]
        v = res["fallback"]["value"]
        assert v["path"] == ""
        assert torch.equal(v["sum"], torch.full((7,), 3.0))
        assert len(v["warnings"]) == 1, v["warnings"]
        category, message = v["warnings"][0]
        assert category == "ShmFallbackWarning"
        assert "do not all share the memory of one machine" in message and "ranks 0 on" in message
        assert "ranks 1 on" in message and "uses the process group (gloo)" in message


def unusable_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    out = {}

    def missing_dir():
        try:
            dcplan.init()
        except RuntimeError as e:
            return {"message": str(e), "initialized": dcplan._C.is_initialized()}
        return {"message": None}

    _run(out, "missing", missing_dir)

    def switched_off():
        os.environ["DCPLAN_SHM"] = "off"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcplan.init()
        y = torch.ops.dc.inference_all_reduce(torch.full((3,), float(rank + 1), dtype=torch.bfloat16))
        return {"path": dcplan._C.local_all_reduce_path(), "sum": y, "warnings": len(caught)}

    _run(out, "off", switched_off)
    _save(out_dir, rank, out)
    dcplan.shutdown()
    dist.destroy_process_group()


def test_an_unusable_directory_is_an_error_on_every_rank_and_off_uses_the_process_group(dcplan_module, shm_dir):
    missing = os.path.join(shm_dir, "missing")
    per_rank = run_ranks(unusable_worker, 2, {"DCPLAN_SHM_DIR": missing})
    for r, res in enumerate(per_rank):
        assert "error" not in res["missing"], res["missing"]["error"]
        m = res["missing"]["value"]
        assert m["message"] is not None, f"rank {r}: init should fail"
        assert f"cannot use {missing}" in m["message"] and "No such file or directory" in m["message"]
        assert "rank 0:" in m["message"] and "rank 1:" in m["message"]
        assert "DCPLAN_SHM=off" in m["message"]
        assert not m["initialized"], "a failed init leaves no runtime behind"
        assert "error" not in res["off"], res["off"]["error"]
        off = res["off"]["value"]
        assert off["path"] == "" and off["warnings"] == 0
        assert torch.equal(off["sum"], torch.full((3,), 3.0, dtype=torch.bfloat16))


def absent_rank_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    dcplan.init()
    out = {}

    gave_up = os.path.join(out_dir, "rank0-gave-up")

    def late():
        if rank == 1:  # rank 1 comes once rank 0 has given up (after 1 s), however late rank 0 started
            deadline = time.monotonic() + 60
            while not os.path.exists(gave_up) and time.monotonic() < deadline:
                time.sleep(0.05)
        torch.ops.dc.inference_all_reduce_(torch.ones(4))

    _run(out, "absent", lambda: _error_of(late))
    if rank == 0:
        open(gave_up, "w").close()
    _save(out_dir, rank, out)
    dcplan.shutdown()
    dist.destroy_process_group()


def test_a_rank_that_never_arrives_ends_in_a_timeout_error(dcplan_module, shm_dir):
    per_rank = run_ranks(absent_rank_worker, 2, {"DCPLAN_SHM_DIR": shm_dir, "DCPLAN_SHM_TIMEOUT": "1"})
    r0 = per_rank[0]["absent"]["value"]
    assert r0["message"] is not None and "rank 0 waited 1 s for rank(s) 1" in r0["message"], r0
    assert "DCPLAN_SHM_TIMEOUT" in r0["message"]
    assert 0.9 < r0["seconds"] < 5
    r1 = per_rank[1]["absent"]["value"]  # arriving late, it finds the group broken
    assert r1["message"] is not None and "rank 0 of the shared-memory group failed" in r1["message"], r1


def killed_rank_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    dcplan.init()
    torch.ops.dc.inference_all_reduce_(torch.ones(4))  # both ranks are in the group
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    out = {}

    _run(out, "killed", lambda: _error_of(lambda: torch.ops.dc.inference_all_reduce_(torch.ones(4))))
    _save(out_dir, rank, out)
    dcplan.shutdown()
    dist.destroy_process_group()


def test_a_killed_rank_is_noticed_and_leaves_no_segment(dcplan_module, shm_dir):
    with tempfile.TemporaryDirectory() as tmp:
        env = {"DCPLAN_SHM_DIR": shm_dir, "DCPLAN_SHM_TIMEOUT": "60"}
        procs = run_own_processes(killed_rank_worker, 2, (2, os.path.join(tmp, "store"), tmp, env), limit_s=120)
        assert procs[1].exitcode == -signal.SIGKILL
        assert procs[0].exitcode == 0
        res = torch.load(os.path.join(tmp, "rank0.pt"), weights_only=False)
    v = res["killed"]["value"]
    assert v["message"] is not None and f"rank 1 (pid {procs[1].pid}) exited" in v["message"], v
    assert v["seconds"] < 5, "the dead rank is noticed well before the 60 s timeout"


def raising_worker(rank, ws, store_file, out_dir, env):
    dcplan = _start(rank, ws, store_file, env)
    dcplan.init()
    torch.ops.dc.inference_all_reduce_(torch.ones(4))
    _save(out_dir, rank, {})
    raise RuntimeError("a user's script fails after the runtime started")


def test_a_script_that_raises_leaves_no_segment(dcplan_module, shm_dir):
    run_ranks(raising_worker, 2, {"DCPLAN_SHM_DIR": shm_dir})
    # shm_dir's fixture checks that the directory is empty


def test_settings_refuse_nonsense(monkeypatch, dcplan_module):
    from dcplan import _shm

    for name, value, expected in (
        ("DCPLAN_SHM", "banana", "DCPLAN_SHM should be 'auto' or 'off', got 'banana'"),
        ("DCPLAN_SHM_TIMEOUT", "-1", "DCPLAN_SHM_TIMEOUT should be a positive number of seconds, got '-1'"),
        ("DCPLAN_SHM_TIMEOUT", "soon", "got 'soon'"),
        ("DCPLAN_SHM_TIMEOUT", "inf", "got 'inf'"),
        ("DCPLAN_SHM_DIR", "", "DCPLAN_SHM_DIR should be a directory"),
    ):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(ValueError, match=expected):
                _shm.settings()
    with monkeypatch.context() as m:
        m.setenv("DCPLAN_SHM", "OFF")
        m.setenv("DCPLAN_SHM_DIR", "/tmp/x/")
        m.setenv("DCPLAN_SHM_TIMEOUT", "2.5")
        assert _shm.settings() == {"shm": False, "shm_dir": "/tmp/x", "shm_timeout_s": 2.5}
