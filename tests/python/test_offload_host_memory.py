"""Where a plan's offloaded optimizer state lives on the host (python/dcplan/_offload.py): each
offload group's memory is allocated when the plan is loaded, before step 0, and every state
tensor's host copy is an aligned view of it, taken once (issue 30: "allocated once, at start, and
reused"). On CPU ranks that memory is outside torch's allocator; on a GPU it is pinned (the same
code with pin_memory=True). The grouped step itself: tests/python/test_optimizer_calls.py; a
training run with it: tests/replay/test_plan_offload.py."""
import gc
import types

import pytest
import torch

from dcplan import _offload

# AdamW's exp_avg and exp_avg_sq in fp32: 8 bytes per element of a shard.
ADAMW_BYTES_PER_ELEMENT = 8


def shards(n, numel=4):
    out = []
    for i in range(n):
        p = torch.nn.Parameter(torch.randn(numel))
        p._dcplan_ds_id = i
        out.append(p)
    return out


def register(groups, params, numel=4, plan="plan.json"):
    infos = [types.SimpleNamespace(ds_id=p._dcplan_ds_id, shard=p) for p in params]
    by_id = {p._dcplan_ds_id: p for p in params}
    nbytes = [sum(ADAMW_BYTES_PER_ELEMENT * by_id[i].numel() for i in ids) for ids in groups]
    _offload.register(infos, groups, [], _offload.allocate(infos, groups, nbytes, [], plan))


def step(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def host_state(opt, params):
    return {(p._dcplan_ds_id, k): t for p in params for k, t in opt.state[p].items() if _offload.is_host(t)}


@pytest.fixture(autouse=True)
def no_plan_left():
    yield
    _offload.forget()


def test_the_host_memory_is_allocated_before_step_0_and_each_state_keeps_its_view(monkeypatch):
    a, b, c = shards(3)
    opt = torch.optim.AdamW([a, b, c], foreach=True)
    register([[1], [2]], [a, b, c])
    pools = {g: pool.buffer for g, pool in _offload._pools.items()}
    # Each the plan's 32 bytes and room to align up to four state tensors of its one parameter.
    assert sorted(pools) == [0, 1] and [buf.numel() for buf in pools.values()] == [32 + 4 * 64] * 2
    assert _offload.host_bytes([[1], [2]], [32, 32]) == 2 * (32 + 4 * 64 + 64)  # and room to start aligned
    allocated = []
    real = _offload.host_empty
    monkeypatch.setattr(_offload, "host_empty", lambda *args: allocated.append(args) or real(*args))
    first = None
    for _ in range(2):
        step(opt, [a, b, c])
        now = host_state(opt, [b, c])
        assert len(now) == 4  # exp_avg and exp_avg_sq of b and c
        first = first or {k: t.data_ptr() for k, t in now.items()}
        assert {k: t.data_ptr() for k, t in now.items()} == first  # the same views every step
    assert allocated == []  # no host memory beyond the pools
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in now.values())
    for (ds_id, _), t in now.items():
        buf = pools[ds_id - 1]  # b's group is 0, c's 1
        assert buf.data_ptr() <= t.data_ptr() and t.data_ptr() + t.nbytes <= buf.data_ptr() + buf.numel()
        assert t.data_ptr() % 64 == 0
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no two overlap
    assert not any(_offload.is_host(t) for t in opt.state[a].values())  # a's state stays on the device


def test_state_beyond_the_plans_bytes_gets_memory_of_its_own_with_one_warning():
    a, b = shards(2, numel=100)
    # Recorded as AdamW (800 bytes a shard: two fp32 moments), run with AMSGrad's third too.
    opt = torch.optim.AdamW([a, b], foreach=True, amsgrad=True)
    register([[0, 1]], [a, b], numel=100, plan="p.json")
    with pytest.warns(UserWarning) as caught:
        step(opt, [a, b])
    messages = [str(w.message) for w in caught if "does not fit" in str(w.message)]
    assert len(messages) == 1, messages  # once per group
    assert messages[0].startswith("dcplan: p.json: /offload/optimizer_state/0/bytes: the plan keeps 1600 bytes")
    assert len(host_state(opt, [a, b])) == 6


def test_a_new_optimizer_takes_the_views_of_one_dropped_and_a_second_live_one_its_own_memory():
    a, b = shards(2)
    register([[0, 1]], [a, b])
    opt = torch.optim.AdamW([a, b], foreach=True)
    step(opt, [a, b])
    ptrs = {k: t.data_ptr() for k, t in host_state(opt, [a, b]).items()}
    del opt
    gc.collect()
    again = torch.optim.AdamW([a, b], foreach=True)
    step(again, [a, b])
    assert {k: t.data_ptr() for k, t in host_state(again, [a, b]).items()} == ptrs
    other = torch.optim.AdamW([a, b], foreach=True)  # beside `again`: must not share its memory
    with pytest.warns(UserWarning, match="does not fit"):
        step(other, [a, b])
    assert not set(t.data_ptr() for t in host_state(other, [a, b]).values()) & set(ptrs.values())


def test_a_dropped_models_pool_goes_with_it():
    params = shards(2)
    register([[0, 1]], params)
    assert len(_offload._pools) == 1
    del params
    gc.collect()
    assert _offload._pools == {}


def test_a_plan_registered_again_after_forget_starts_from_new_memory():
    """dcplan.shutdown() forgets the plan; ds_ids start again at 0 for the next model, whose
    optimizer must not get the old model's views."""
    a, b = shards(2)
    register([[0, 1]], [a, b])
    opt = torch.optim.AdamW([a, b], foreach=True)
    step(opt, [a, b])
    old = {t.data_ptr() for t in host_state(opt, [a, b]).values()}
    _offload.forget()
    c, d = shards(2)  # the next model's, with the same ds_ids
    register([[0, 1]], [c, d])
    nxt = torch.optim.AdamW([c, d], foreach=True)
    step(nxt, [c, d])
    new = {t.data_ptr() for t in host_state(nxt, [c, d]).values()}
    assert len(new) == 4 and not new & old
    pool = _offload._pools[0].buffer
    assert all(pool.data_ptr() <= p < pool.data_ptr() + pool.numel() for p in new)
