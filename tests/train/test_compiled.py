"""Compiled replay (dcplan.shard(..., compile=True)) on 2 Gloo ranks against single-process
training under torch.compile: every stage, gradient accumulation, tied weights, a module called
twice, a frozen parameter; and the dc ops the compiled graphs issue."""
import pytest

import compiled_cases as cc
from mp_harness import entry, run_ranks
from train_harness import assert_trained_like

pytestmark = pytest.mark.multiprocess

CASES = [("base", s, 1) for s in (1, 2, 3)] + [("base", s, 2) for s in (1, 2, 3)] + [
    (v, 3, 1) for v in ("tied", "twice", "frozen")] + [("tied", 1, 2)]
# fp32 on both sides, both compiled by Inductor: the two runs differ in how the 2 ranks' gradient
# sum is ordered (as eager, tests/python/test_equivalence.py) and in Inductor's kernels for a batch
# of 2 rows against 4 (another blocking of the same reductions): rounding of order 1e-7 relative
# per op, which AdamW's first steps (update ~ lr * sign) do not amplify; 4 steps stay within
# the eager matrix's tolerances.
LOSS_TOL = dict(rtol=1e-5, atol=0)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


def _name(v, s, a):
    return f"{v}-zero{s}-accum{a}"


@pytest.fixture(scope="module")
def results(dcplan_module):
    return run_ranks(cc.worker, 2, CASES)


@pytest.mark.parametrize("variant,stage,accum", CASES, ids=[_name(*c) for c in CASES])
def test_matches_single_process_compiled(results, variant, stage, accum):
    res = entry(results, _name(variant, stage, accum))
    assert_trained_like(res["value"], res["reference"], LOSS_TOL, PARAM_TOL)


def _ops(log, graph):
    return [(op, i) for op, g, i, b, dt in log if g == graph]


def test_zero3_graph_order():
    pass
