"""Models beyond the tiny transformer's habits, sharded on 2 Gloo ranks against one process:
parameters read outside their module's forward, and activation checkpointing
(torch.utils.checkpoint, use_reentrant False and True), at every stage, with an eval forward
between steps."""
import pytest

import model_cases as mc
from mp_harness import entry, run_ranks
from train_harness import assert_trained_like

pytestmark = pytest.mark.multiprocess

VARIANTS = ["base", "reader", "ckpt", "ckpt-reader", "reentrant-ckpt", "reentrant-ckpt-reader"]
CASES = [(v, s) for v in VARIANTS for s in (1, 2, 3)]
# fp32 on both sides; 2 ranks sum gradients in another order than one process: the equivalence
# matrix's tolerances (tests/python/test_equivalence.py).
LOSS_TOL = dict(rtol=1e-5, atol=0)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def results(dcplan_module):
    return run_ranks(mc.worker, 2, CASES)


@pytest.mark.parametrize("variant,stage", CASES, ids=[f"{v}-zero{s}" for v, s in CASES])
def test_matches_single_process(results, variant, stage):
    res = entry(results, f"{variant}-zero{stage}")
    got, ref = res["value"], res["reference"]
    assert_trained_like(got, ref, LOSS_TOL, PARAM_TOL)


def _ops(log, graph):
    return [(op, i) for op, g, i, b, dt in log if g == graph]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_recomputation_gathers_on_the_backward_graph(results, stage):
    """Checkpointing changes no forward op; its re-gathers are the backward graph's (ZeRO-3: where
    the saved-tensor re-gathers would be; ZeRO-1/2 hold every parameter, so nothing moves)."""
    base = entry(results, f"base-zero{stage}")["value"]
    ckpt = entry(results, f"ckpt-zero{stage}")["value"]
    bf, (cf, cb) = base["graphs"][0], ckpt["graphs"]
    assert _ops(ckpt["op_log"], cf) == _ops(base["op_log"], bf)
    gathers = [i for op, i in _ops(ckpt["op_log"], cb) if op == "allgather_param"]
    if stage == 3:
        assert gathers, "no re-gather in the backward graph"
        releases = [i for op, i in _ops(ckpt["op_log"], cb) if op == "release_param"]
        assert sorted(releases) == sorted(gathers)


def test_checkpointed_reader_reads_on_the_backward_graph(results):
    """A checkpointed module that reads another module's parameter reads it again in backward:
    gathered there on the backward graph (ZeRO-3)."""
    ckpt = entry(results, "ckpt-reader-zero3")["value"]
    plain = entry(results, "ckpt-zero3")["value"]
    bwd, ids = ckpt["graphs"][1], ckpt["ids"]
    gathered = [i for op, i in _ops(ckpt["op_log"], bwd) if op == "allgather_param"]
    # At least its first read: non-reentrant checkpointing stops recomputing once it has every
    # saved tensor it needs (the second read saves nothing).
    assert gathered.count(ids["embed.weight"]) >= 1
    assert _ops(plain["op_log"], plain["graphs"][1]).count(("allgather_param", plain["ids"]["embed.weight"])) == 0


def test_outside_reads_gather_once_per_forward(results):
    """ZeRO-3: a parameter read outside its module is gathered once per forward however often it
    is read (the embedding's weight: by its module and twice by the reader; a block's norm weight
    by its module and by the root), and released at once (the reader's tensor keeps its memory)."""
    reader = entry(results, "reader-zero3")["value"]
    ops, ids = _ops(reader["op_log"], reader["graphs"][0]), reader["ids"]
    for name in ("embed.weight", "blocks.2.norm.weight", "blocks.0.up.bias"):
        assert ops.count(("allgather_param", ids[name])) == 2, name
        assert ops.count(("release_param", ids[name])) == 2, name
    base = entry(results, "base-zero3")["value"]
    assert _ops(base["op_log"], base["graphs"][0]).count(("allgather_param", base["ids"]["embed.weight"])) == 1
