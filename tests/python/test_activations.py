"""The recorder's count of saved activations (python/dcplan/_activations.py) on one process: the
trial forward, which moves every counted save to the host, trains exactly as without it and finds
where each storage's memory leaves the device; and a recording of examples/train_llama.py on 2 CPU
ranks writes them into the trace."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from mp_harness import dcplan_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Block(nn.Module):
    """Two saves that outlive their op until the block returns (its locals), an output the caller
    holds, and a view of one storage saved twice."""

    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.a(x)  # a saves x (the caller's)
        g = torch.relu(h)  # relu saves its output g, which b saves again
        y = self.b(g)
        return x + torch.tanh(y)  # tanh saves its output, the block's temporary


def run(model, x, forward):
    """Loss and gradients of one step, the forward's saves passed through `forward` (None: as torch)."""
    from dcplan import _activations

    model.zero_grad()
    if forward is None:
        out = model(x)
    else:
        # As the ZeRO-3 hooks do, the parameters are not handed on (they are gathered again instead).
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            return t if t.untyped_storage().data_ptr() in params else forward.pack(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, _activations.unpack):
            out = model(x)
            forward.end()
    loss = out.square().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_the_trial_trains_alike_and_finds_where_each_save_leaves_the_device(dcplan_module):
    from dcplan import _activations

    torch.manual_seed(0)
    width, rows = 64, 256  # each saved activation at least 64 KiB (MIN_BYTES)
    model = nn.Sequential(Block(width), Block(width))
    x = torch.randn(rows, width, requires_grad=True)
    plain = run(model, x, None)
    trial = _activations.Forward(0, 1, torch.device("cpu"), trial=True)
    tried = run(model, x, trial)
    assert tried[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(tried[1], plain[1]))

    found = trial.findings()
    # Per block: x (a), h's relu output g (relu, and b again: one storage, two saves), tanh's output.
    # The input x and block 1's output (block 2's input) are held by their callers.
    saves = [e.packs for e in trial.entries]
    assert found.saves == 8 and saves == [[0], [1, 2], [3], [4], [5, 6], [7]], saves
    # Gone by which save (8: the forward's end), looked at before each save and at the end.
    freed = {e.packs[0]: e.freed_before for e in trial.entries}
    assert freed[0] is None  # the model's input: the test holds it
    assert freed[1] == 4  # g, block 1's local: still there at its tanh's save (3), gone once it returned
    assert freed[3] == 4  # tanh's output, a temporary of the residual sum
    assert freed[4] == 8  # block 1's output, block 2's input: Sequential holds it until block 2 returns
    assert freed[5] == 8 and freed[7] == 8  # block 2's, once it returned
    assert all(b >= _activations.MIN_BYTES for b, _ in found.freed.values())


def test_a_storage_whose_address_is_reused_is_another_activation(dcplan_module):
    """A storage freed on the device after its move to the host may leave its address to the next
    tensor saved; that one is a storage of its own, not another save of the first."""
    from dcplan import _activations

    def chain(x):
        for _ in range(4):
            x = torch.sigmoid(x)  # saves its output; the previous output dies once nothing holds it
        return x

    x = torch.randn(256, 128, requires_grad=True)
    plain = torch.autograd.grad(chain(x).sum(), x)[0]
    trial = _activations.Forward(0, 1, torch.device("cpu"), trial=True)
    with torch.autograd.graph.saved_tensors_hooks(trial.pack, _activations.unpack):
        out = chain(x)
        trial.end()
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], plain)
    assert [e.packs for e in trial.entries] == [[0], [1], [2], [3]]


@pytest.mark.multiprocess
def test_a_recording_carries_what_the_forwards_saved(tmp_path, dcplan_module):
    model = ["--layers", "3", "--hidden", "192", "--heads", "6", "--seq", "96", "--vocab", "768", "--fused"]
    script = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              os.path.join(ROOT, "examples", "train_llama.py"), "--device", "cpu", *model]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trace = tmp_path / "trace.json"
    recorded = subprocess.run([dcplan_binary(), "record", "-v", "-o", str(trace), "--steps", "2", "--warmup", "1", "--",
                               *script, "--steps", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert recorded.returncode == 0, recorded.stderr[-3000:]
    t = json.loads(trace.read_text())
    forwards = [g for s in t["steps"] for g in s["graphs"] if g["kind"] == "forward"]
    assert forwards and all(g.get("saved_activations") for g in forwards), "no forward's saves recorded"
    for g in forwards:
        saved, ops = g["saved_activations"], len(g["events"])
        assert [a["packs"][0] for a in saved] == sorted(a["packs"][0] for a in saved)
        assert all(a["bytes"] >= 64 << 10 and 0 <= a["seq"] <= ops for a in saved)
        freed = [a for a in saved if "freed_at" in a]
        # The trial ran (warm-up step 0) and found what was saved gone by the forward's end: each
        # block's temporaries once it returned, its input once the next block had returned (10.4 MiB
        # of 10.4 in a run here). More than 80% of it, so that a model change that keeps some held
        # does not fail this, but a trial that finds nothing does.
        assert sum(a["bytes"] for a in freed) > 0.8 * sum(a["bytes"] for a in saved), saved
        assert all(a["seq"] <= a["freed_at"] <= ops for a in freed)
        assert all("used_at" in a for a in saved), "a save the backward never read"
    shown = subprocess.run([dcplan_binary(), "inspect", str(trace)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "saved for backward per step: " in shown.stdout, shown.stdout

    # The trial step trains as a plain run does: the recording's losses are those of training without it.
    def losses(out):
        return [line.split()[3] for line in out.splitlines() if line.startswith("step ")]

    plain = subprocess.run([*script, "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # dcplan record -v passes the command's output on to stderr.
    assert losses(recorded.stderr)[:2] == losses(plain.stdout) and len(losses(plain.stdout)) == 2, \
        (recorded.stderr, plain.stdout)


def test_planned_saves_move_through_their_slots_one_forward_at_a_time(dcplan_module):
    """A plan's saves (HostSlots) move into host memory and back with the numbers unchanged; a second
    forward while the first one's saves are held keeps its own on the device (warned once), since its
    copies would overwrite the first one's; once the first graph is gone the slots serve again."""
    from dcplan import _activations
    from dcplan._plan import PlanDepartureWarning

    torch.manual_seed(0)
    width, rows = 64, 256
    model = nn.Sequential(Block(width), Block(width))
    x = torch.randn(rows, width, requires_grad=True)
    plain = run(model, x, None)
    g_bytes = rows * 4 * width * 4  # g: relu's output, first saved at save 1 (and again at 2)
    slots = _activations.HostSlots("plan.json", "/graphs/0/offload_saves", [(1, g_bytes), (5, g_bytes)],
                                  torch.device("cpu"))
    first = slots.forward(0, 1, torch.device("cpu"))
    moved = run(model, x, first)
    assert moved[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(moved[1], plain[1]))
    assert [e.packs for e in first.entries] == [[1, 2], [5, 6]]  # only the plan's, with their later saves
    # Each came back once for both its reads (a copy per read would have started the count again),
    # and the copy went with the reads: the device memory the plan's model counts.
    assert all(e.reads == 2 and e.back is None for e in first.entries)
    del first

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = slots.forward(0, 1, torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t if t.untyped_storage().data_ptr() in params else held.pack(t), _activations.unpack):
        out = model(x)
    with pytest.warns(PlanDepartureWarning, match="still held"):
        assert slots.forward(0, 1, torch.device("cpu")) is None
    assert slots.forward(0, 1, torch.device("cpu")) is None  # warned once
    out.square().mean().backward()
    del out, held
    assert slots.forward(0, 1, torch.device("cpu")) is not None  # the first graph is gone


def test_the_recorders_own_work_is_timed_even_when_it_raises_and_a_plans_saves_are_not_its(dcplan_module,
                                                                                            monkeypatch):
    """The recorder's bookkeeping (_record.own_work) reports its time to the host clock that the
    trace's host times leave it out of (recorder::addOwnHostWorkNs): once per call, also when the
    work raises; a plan's saves (HostSlots) are the replay's own work and are not reported."""
    from dcplan import _activations, _record

    reported = []
    monkeypatch.setattr(_record._C, "record_own_host_work", reported.append)
    assert _record.own_work(lambda a, b: a + b, 2, 3) == 5
    assert len(reported) == 1 and reported[0] >= 0

    def fails():
        raise ValueError("bookkeeping failed")

    with pytest.raises(ValueError, match="bookkeeping failed"):
        _record.own_work(fails)
    assert len(reported) == 2

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(16)), torch.randn(8, 16, requires_grad=True)
    reported.clear()
    run(model, x, _activations.Forward(0, 1, torch.device("cpu"), trial=True))
    assert reported, "the recorder's trial forward's saves are its own work"
    reported.clear()
    slots = _activations.HostSlots("plan.json", "/graphs/0/offload_saves", [(1, 8 * 64 * 4)], torch.device("cpu"))
    run(model, x, slots.forward(0, 1, torch.device("cpu")))
    assert reported == []
