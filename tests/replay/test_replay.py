"""Plans drive the runtime: same numbers with a plan, the replay log follows it, bad plans and departures."""
import pytest
import torch

import replay_cases
from mp_harness import entry, gpu_ranks, require_gpus, run_ranks

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", params=[(2, "gloo"), (3, "gloo"), (gpu_ranks(), "nccl")],
                ids=["ws2", "ws3", f"nccl-ws{gpu_ranks()}"])
def runs(request, dcplan_module):
    """Spawns one process per rank once per world size and backend; every case runs inside them.

    nccl: the same cases on 2 GPUs ($DCPLAN_TEST_GPUS) through dcplan's NCCL transport; skipped
    visibly without them.
    """
    ws, backend = request.param
    if backend == "nccl":
        require_gpus(dcplan_module, ws)
    return ws, run_ranks(replay_cases.worker, ws, backend, label=f" ({backend})")


def value(per_rank, name, rank=None):
    """The value of case name on every rank (a list), or on one rank."""
    entry(per_rank, name)
    return [res[name]["value"] for res in per_rank] if rank is None else per_rank[rank][name]["value"]


def assert_same_numbers(got, want, what):
    # Other bucket boundaries sum the same numbers per element; on 3 ranks the order of a
    # ring's additions may differ in the last bit.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0,
                               msg=lambda m: f"{what}: losses differ: {m}")
    assert sorted(got["params"]) == sorted(want["params"])
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name], w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{what}: parameter {n}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", replay_cases.PLAN_KINDS)
def test_plan_keeps_numbers_and_is_followed(runs, stage, kind):
    ws, per_rank = runs
    import dcplan

    base = value(per_rank, f"zero{stage}-baseline", 0)
    for rank, got in enumerate(value(per_rank, f"zero{stage}-{kind}")):
        assert_same_numbers(got, base, f"zero{stage}-{kind} rank {rank}")
        plan, log = got["plan"], got["log"]
        assert dcplan.replay_differences(plan, log) == []
        # Beyond the comparison helper: the log's own numbers.
        execs = dcplan._plan.executions(log)
        assert len(execs) == 2 * replay_cases.STEPS * replay_cases.MICRO
        fwd_groups = plan["graphs"][0]["prefetch"]
        for ex in execs:
            pre = [e for e in ex["events"] if e["ev"] == "prefetch"]
            want = plan["graphs"][0 if ex["kind"] == "forward" else 1]["prefetch"]
            assert [(e["pos"], e["ds_ids"]) for e in pre] == [(g["position"], g["ds_ids"]) for g in want]
            # A prefetch is launched before the op at its position.
            ops = {e["pos"]: i for i, e in enumerate(ex["events"]) if e["ev"] == "op"}
            for e in pre:
                assert ex["events"].index(e) > ops[e["pos"]] - 0  # logged right after that op's line
        assert fwd_groups, "the plan prefetches in forward"
        launched = [i for e in log if e["ev"] == "prefetch" for i in e["launched"]]
        assert launched, "planned prefetches gathered something"
        # Every gather is planned ahead, so no allgather_param gathers on use: a module's own fused
        # prefetch or a planned group got there first.
        for ex in execs:
            op_at = {e["pos"]: e["op"] for e in ex["events"] if e["ev"] == "op"}
            ons = [e for e in ex["events"] if e["ev"] == "gather" and op_at[e["pos"]] == "allgather_param"]
            assert ons == [], ons[:3]
        bwd = [ex for ex in execs if ex["kind"] == "backward" and (stage > 1 or ex["sync"])]
        nbuckets = len(plan["graphs"][1]["buckets"])
        for ex in bwd:
            assert sum(e["ev"] == "flush" for e in ex["events"]) == nbuckets
        if kind == "single_bucket":
            assert nbuckets == 1
        kept = {e["ds_id"] for e in log if e["ev"] == "release" and e["kept"]}
        # Before an optimizer step a persistent copy ends at its backward release (stale after it;
        # one backward never reads ends after the backward).
        dropped = {e["ds_id"] for ex in execs if not (ex["kind"] == "backward" and ex["sync"])
                   for e in ex["events"] if e["ev"] == "release" and not e["kept"]}
        if stage == 3:
            assert kept == set(plan["persistent"]) and not kept & dropped
            ends = {(e["position"], e["ds_id"]) for e in plan["graphs"][1].get("persistent_ends", [])}
            assert {i for _, i in ends} <= kept
            assert not any(e["kept"] for ex in execs if ex["kind"] == "backward" and ex["sync"]
                           for e in ex["events"] if e["ev"] == "release" and (e["pos"], e["ds_id"]) in ends)
            # Each persistent parameter is gathered exactly once per optimizer step.
            for step in range(replay_cases.STEPS):
                for i in plan["persistent"]:
                    n = sum(1 for ex in execs if ex["step"] == step for e in ex["events"]
                            if (e["ev"] == "gather" and i in e["ds_ids"])
                            or (e["ev"] == "prefetch" and i in e["launched"]))
                    assert n == 1, (step, i, n)
        else:
            assert not dropped


def test_each_rank_s_log_names_the_rank_that_wrote_it(runs):
    """The plan lines say which rank of how many wrote the log: dcplan plan --calibrate groups
    several runs' logs by it (docs/replay.md)."""
    ws, per_rank = runs
    for rank, got in enumerate(value(per_rank, "zero3-all_persistent")):
        plans = [e for e in got["log"] if e["ev"] == "plan"]
        assert plans and all((e["rank"], e["world_size"]) == (rank, ws) for e in plans), plans


def test_persistent_copies_end_with_their_last_use_before_a_step(runs):
    """ZeRO-3, every parameter persistent: a backward that ends in an optimizer step keeps no
    persistent copy past its last use (only copies backward never reads stay to its end); one
    within gradient accumulation keeps them all for the next forward."""
    ws, per_rank = runs
    for rank, got in enumerate(value(per_rank, "zero3-all_persistent")):
        ids = sorted(i[0] for i in got["infos"])
        # Autograd saves neither the embedding's weight, the added position table nor a linear
        # layer's bias: backward never reads their copies.
        never_read = {"pos", "embed.weight", "block.attn.proj.bias", "block.mlp.0.bias", "block.mlp.2.bias"}
        unread = sorted(i[0] for i in got["infos"] if i[1] in never_read)
        held = got["held_in_backward"]
        assert len(held) == replay_cases.STEPS * replay_cases.MICRO, held
        for k, h in enumerate(held):
            syncs = k % replay_cases.MICRO == replay_cases.MICRO - 1
            assert h == (unread if syncs else ids), f"rank {rank}, backward {k}: held {h}"


def test_bf16_plan(runs):
    """Gathers in bf16: planned prefetches gather in bf16 too, so every op finds its copy."""
    ws, per_rank = runs
    import dcplan

    base = value(per_rank, "zero3-bf16-baseline", 0)
    for rank, got in enumerate(value(per_rank, "zero3-bf16-prefetch")):
        assert_same_numbers(got, base, f"zero3-bf16-prefetch rank {rank}")
        assert dcplan.replay_differences(got["plan"], got["log"]) == []
        for ex in dcplan._plan.executions(got["log"]):
            op_at = {e["pos"]: e["op"] for e in ex["events"] if e["ev"] == "op"}
            assert not [e for e in ex["events"] if e["ev"] == "gather" and op_at[e["pos"]] == "allgather_param"]
    fp32 = value(per_rank, "zero3-baseline", 0)
    assert base["losses"] != fp32["losses"]  # the bf16 run really computes in bf16


def test_comparison_catches_a_changed_plan(runs):
    """replay_differences is not blind: the same log against other groups, buckets or persistence."""
    ws, per_rank = runs
    import dcplan

    got = value(per_rank, "zero3-prefetch", 0)
    plan, log = got["plan"], got["log"]
    moved = {**plan, "graphs": [dict(g) for g in plan["graphs"]]}
    moved["graphs"][0]["prefetch"] = [{**g, "position": g["position"] + 1} for g in plan["graphs"][0]["prefetch"]]
    assert any("prefetch groups" in d for d in dcplan.replay_differences(moved, log))
    merged = {**plan, "graphs": [dict(g) for g in plan["graphs"]]}
    b = plan["graphs"][1]["buckets"]
    merged["graphs"][1]["buckets"] = [{**b[0], "ds_ids": b[0]["ds_ids"] + b[1]["ds_ids"]}] + b[2:]
    assert any("flushed buckets" in d for d in dcplan.replay_differences(merged, log))
    # (A plan without persistent parameters names no ends of their copies either.)
    unkept = {**plan, "persistent": [],
              "graphs": [{k: v for k, v in g.items() if k != "persistent_ends"} for g in plan["graphs"]]}
    assert any("kept" in d or "dropped" in d for d in dcplan.replay_differences(unkept, log))


def test_signature_matches_the_documented_bytes(runs, dcplan_module):
    """The C++ signature against docs/formats.md, recomputed here byte by byte."""
    ws, per_rank = runs
    base = value(per_rank, "zero3-baseline", 0)
    text = "".join(f"{i}\t{name}\t{'x'.join(map(str, shape))}\tfloat32\n" for i, name, shape, _, _ in base["infos"])
    text += f"world_size\t{ws}\n"
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    assert base["signature"] == f"fnv1a64:{h:016x}"
    names = [n for _, n, _, _, _ in base["infos"]]
    assert names == [n for n, _ in replay_cases.make_model().named_parameters()]
    assert dcplan_module._C.param_signature([(0, "w", [2, 3], "float32", True)], 2) == "fnv1a64:f7984124c8ca94da"


def test_bad_plans_are_refused_at_start(runs):
    ws, per_rank = runs
    for got in value(per_rank, "refusals"):
        path, msg = got["world_size"]
        assert msg == f"{path}: /source/world_size: the plan is for {ws + 1} ranks, this run has {ws}"
        path, msg = got["model"]
        assert msg.startswith(f"{path}: /source/param_signature: the plan is for another model"), msg
        path, msg = got["other_model"]
        assert msg.startswith(f"{path}: /source/param_signature: the plan is for another model"), msg
        path, msg = got["stage"]
        assert msg == f"{path}: /source/stage: the plan is for ZeRO stage 2, this run uses stage 3"
        path, msg = got["dtype"]
        assert msg == f"{path}: /graphs/1/buckets/0/dtype: the plan reduces in bfloat16, this run reduces in float32"
        path, msg = got["graph_kind"]
        assert msg == f"{path}: /graphs/0/kind: graph 0 is this model's forward, the plan says backward"
        path, msg = got["master_compiled"]
        assert msg.startswith(f"{path}: /offload/optimizer_state/0/master_bytes: master shards kept on the host are "
                              "not supported with dcplan.shard(compile=True) yet"), msg
        path, msg = got["corrupt"]
        assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
        assert got["env"].endswith(f"/source/world_size: the plan is for {ws + 1} ranks, this run has {ws}")
        assert got["arg_wins"] is True
        assert "read other contents (the file changed on disk between the ranks' loads" in got["differs"], got["differs"]
        assert "every rank must follow the same plan" in got["differs"]


def first_difference(a, b):
    for q, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return q
    return min(len(a), len(b))


def describe(op, names):
    """An op as the departure message names it: the parameter's qualified name and its ds_id."""
    return f"{op[0]} of {names[op[1]]} (ds_id {op[1]})" if op[1] >= 0 else op[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_departure_error_names_the_position(runs, stage):
    ws, per_rank = runs
    base = value(per_rank, f"zero{stage}-baseline", 0)
    ref = value(per_rank, f"depart{stage}-reference", 0)
    normal = next(ops for g, ops in replay_cases.executions(base["op_log"]) if g == base["fwd"])
    twice = next(ops for g, ops in replay_cases.executions(ref["op_log"]) if g == ref["fwd"])
    q = first_difference(normal, twice)
    names = {ds_id: name for ds_id, name, *_ in base["infos"]}
    want = (f"the run departs from the plan in graph {base['fwd']} (forward) at position {q}: "
            f"expected {describe(normal[q], names)}, got {describe(twice[q], names)}")
    for got in value(per_rank, f"depart{stage}-error"):
        assert want in got["message"], got["message"]


@pytest.mark.parametrize("stage", [1, 3])
def test_departure_fallback_keeps_numbers(runs, stage):
    ws, per_rank = runs
    ref = value(per_rank, f"depart{stage}-reference", 0)
    for rank, got in enumerate(value(per_rank, f"depart{stage}-fallback")):
        assert_same_numbers(got, ref, f"depart{stage}-fallback rank {rank}")
        deps = [w for w in got["warnings"] if w[0] == "PlanDepartureWarning"]
        assert len(deps) == 1, got["warnings"]
        assert "departs from the plan" in deps[0][1] and "continuing without the plan" in deps[0][1]
        log = got["log"]
        departures = [e for e in log if e["ev"] == "departure"]
        assert len(departures) == 1 and departures[0]["action"] == "fallback"
        # The plan drove the steps before the departure, the default schedule the ones after.
        execs = __import__("dcplan")._plan.executions(log)
        before = [ex for ex in execs if ex["step"] < replay_cases.DEPART_STEP]
        after = [ex for ex in execs if ex["step"] > replay_cases.DEPART_STEP]
        assert any(e["ev"] == "prefetch" for ex in before for e in ex["events"])
        assert not any(e["ev"] == "prefetch" for ex in after for e in ex["events"])


def test_departure_in_the_first_step(runs):
    """Leaving out the block from the start: the prefetched block parameters are never gathered."""
    ws, per_rank = runs
    for got in value(per_rank, "skip-error"):
        msg = got["message"]
        assert "the run departs from the plan in graph 0 (forward) at position" in msg, msg
        assert "expected" in msg and "got the end of the graph" in msg, msg
