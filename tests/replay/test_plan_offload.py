"""Planned offload on 2 CPU ranks, for a model and sizes the demo does not use (wide layers, short
sequences: the optimizer state is most of what a rank holds): dcplan record -> plan at a budget
under the least any schedule needs with the optimizer state on the device -> inspect -> replay ->
check, at two budgets: just above what it needs with all optimizer state offloaded, and 60% of the
on-device floor, below that, where master shards go to the host too; and, for a model of longer
sequences, below what it needs with every master shard offloaded, where saved activations go to
the host too. Asserted: the plan offloads
what the budget needs and predicts a peak within it, inspect shows it, the replay's losses equal
training without a plan bit for bit, each rank's peak stays within the budget and within 3% of
the prediction, and a new job resumed from a checkpoint saved after 3 steps (examples/train_llama.py
--save / --resume) loads it within the budget and goes on with the same losses; and a rank told
that more ranks share its host than its memory holds the offload for refuses before step 0, the
other rank with it. The step
time is a benchmark (docs/benchmarks.md)."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from mp_harness import dcplan_binary, offload_floors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A vocabulary the 2 ranks do not divide: the embedding's and the head's checkpoint rows go through
# the state dicts' layout exchange (docs/checkpoints.md), the rest straight into the shards.
MODEL = ["--layers", "3", "--hidden", "384", "--heads", "6", "--seq", "16", "--vocab", "767", "--fused"]
# The target for the peak (docs/planning.md, "Offload": 0%, 0% and -1% measured over three recordings).
PEAK_TOLERANCE = 0.03
# The budget: this far above the least the plan needs with all the optimizer state offloaded, so that
# the planner must offload most of it; the recording's activations vary a little from run to run.
ABOVE_OFFLOAD_FLOOR = 1.08
# The budget (issue 30): this share of the least any schedule needs with everything on the
# device, or less where the state alone meets it: 3% under what the plan needs with all optimizer
# state offloaded (0.60-0.62 of the on-device floor in two recordings of this model; every master
# shard offloaded too needs 0.44), so that the planner must put master shards on the host.
ON_DEVICE_SHARE = 0.6
UNDER_STATE_FLOOR = 0.97
# A model whose saved activations are most of what a rank holds (the budget guard test's, with
# longer sequences): every master shard offloaded still needs 25.4 MiB in two recordings here, every
# saved activation offloaded too 8.3 and 8.6 MiB. (At 96 tokens, 13.0 against 7.5 MiB in three
# recordings, but one recording in the test put the optimizer step's peak at 13.5 MiB, which no
# saved activation lowers: both floors the same.)
ACTIVATIONS_MODEL = ["--layers", "3", "--hidden", "192", "--heads", "6", "--seq", "192", "--vocab", "768", "--fused"]
# What a resumed job may hold beyond an uninterrupted one at a step's first op: the scalars a load
# makes (measured: 20 B), under the smallest shard's state kept on the device by mistake (a norm
# weight's moments: 1.5 KiB).
RESUMED_SLACK = 1 << 10

pytestmark = pytest.mark.multiprocess


def script(steps, model=MODEL):
    return [os.path.join(ROOT, "examples", "train_llama.py"), "--steps", str(steps), *model]


def train(steps, model=MODEL):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *script(steps, model)]


def run(cmd, env=None, expect=0):
    """cmd's result, its exit code expected to be `expect` (None: any)."""
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                         text=True, timeout=300)
    assert expect is None or res.returncode == expect, \
        f"{' '.join(cmd)} exited {res.returncode}, expected {expect}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def size(text):
    number, unit = re.fullmatch(r"([0-9.]+) (B|KiB|MiB|GiB)", text).groups()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def losses(out):
    return re.findall(r"^step +\d+ +loss (\S+)", out, re.M)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, dcplan_module):
    """MODEL's trace (dcplan record, 2 steps after 1) and its 6 losses without a plan: one of each for
    both budgets' cases, which plan the same recording."""
    trace = tmp_path_factory.mktemp("offload") / "trace.json"
    recording = run([dcplan_binary(), "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *train(6)])
    # (CI, 2026-11-28, fef1d21: a recording whose all-state floor read 47.6 MiB, where this machine's
    # read 33.5-35.5 MiB, and both cases' replays 6-13% over their predictions. Gloo's allgather, whose
    # worker buffer came and went as the scheduler ran it, moved recordings by 1.5-3 MiB and is no
    # longer used (docs/planning.md, memory model); the rest is not explained. A failure's captured
    # output shows the recording's warnings.)
    print("the recording's warnings:", [line for line in recording.stderr.splitlines() if "arning" in line])
    reference = losses(run(train(6)).stdout)
    assert len(reference) == 6, reference
    return trace, reference


def test_a_budget_under_the_on_device_floor_is_planned_with_offload_and_kept(tmp_path, recorded):
    offload_case(tmp_path, recorded, masters=False)


def test_sixty_percent_of_the_on_device_floor_offloads_master_shards_too_and_is_kept(tmp_path, recorded):
    offload_case(tmp_path, recorded, masters=True)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_below_every_master_floor_saved_activations_go_to_the_host_too(tmp_path, dcplan_module, grad_accum):
    """With 2 micro-steps a step, each forward's saves go through the same host memory in turn."""
    exe = dcplan_binary()
    trace, plan = tmp_path / "trace.json", tmp_path / "activations.json"
    model = [*ACTIVATIONS_MODEL, "--grad-accum", str(grad_accum)]
    run([exe, "record", "-o", str(trace), "--steps", "2", "--warmup", "1", "--", *train(6, model)])
    state_floor, masters_floor, saves_floor = offload_floors(exe, trace)
    assert saves_floor < masters_floor < state_floor, (saves_floor, masters_floor, state_floor)
    # Halfway between: the plan must move some saved activations, and not all of them.
    budget = (saves_floor + masters_floor) // 2
    run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", f"{budget}B"])
    p = json.loads(plan.read_text())
    saves = [s for g in p["graphs"] for s in g.get("offload_saves", [])]
    movable = [a for s in json.loads(trace.read_text())["steps"][:1] for g in s["graphs"]
               for a in g.get("saved_activations", []) if "freed_at" in a and "used_at" in a]
    assert 0 < len(saves) < len(movable), (len(saves), len(movable))
    # Each micro-step moves them: a step's bytes are theirs times the micro-steps.
    assert p["predicted"]["activation_offload_bytes"] == grad_accum * sum(s["bytes"] for s in saves)
    assert all("master_bytes" in g for g in p["offload"]["optimizer_state"])
    predicted = p["predicted"]["peak_memory_bytes"]
    assert predicted <= budget
    shown = run([exe, "inspect", str(plan)]).stdout
    assert re.search(rf"offload: {len(saves)} saved activations on the host from their save until the backward "
                     r"reads them", shown), shown

    log = tmp_path / "activations.{rank}.jsonl"
    replayed = run(train(6, model), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)})
    reference = run(train(6, model)).stdout
    assert losses(replayed.stdout) == losses(reference) and len(losses(reference)) == 6, (replayed.stdout, reference)
    assert "PlanDepartureWarning" not in replayed.stderr, replayed.stderr[-3000:]
    # (CI, 2026-11-28: both ranks at 17.2 MiB against a 17.0 MiB budget and 16.9 predicted, in about
    # one run of fifteen; hence the check's curve on a failure.)
    checked_memory(exe, trace, plan, log, budget, predicted)


def refused_on_a_full_host(plan, groups):
    """Rank 0 is told twice as many ranks share its host as its available memory holds the plan's
    offload for (LOCAL_WORLD_SIZE, which torchrun sets; the ranks are started here without it), rank
    1 that two do: at dcplan.shard(), before step 0, rank 0 refuses with the bytes needed and
    available and rank 1 with it (the ranks agree: neither waits for the other at a collective)."""
    from dcplan import _host_memory

    state, masters = sum(g["bytes"] for g in groups), sum(g.get("master_bytes", 0) for g in groups)
    ranks = 2 * _host_memory.available()[0] // (state + masters) + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DCPLAN_PLAN": str(plan), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, *script(1)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": str(ranks if r == 0 else 2)}) for r in range(2)]
    said = [(f"MemoryError: dcplan.shard: {plan}: /offload/optimizer_state: the plan keeps "
             f"{_host_memory.size(state + masters)} in host memory on each rank (optimizer state "
             f"{_host_memory.size(state)}, master shards {_host_memory.size(masters)}) and {ranks} rank(s) run on "
             f"this host ($LOCAL_WORLD_SIZE): {_host_memory.size((state + masters) * ranks)} needed, "),
            f"MemoryError: dcplan.shard: {plan}: /offload/optimizer_state: another rank's host lacks the memory"]
    try:
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode != 0 and not losses(out), (r, out, err)
            assert said[r] in err, (r, said[r], err[-3000:])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def offload_case(tmp_path, recorded, masters):
    """recorded: MODEL's trace and losses without a plan; masters=False: the budget just above the
    all-state floor; True: ON_DEVICE_SHARE of the on-device floor, which needs master shards on the host."""
    exe = dcplan_binary()
    (trace, reference), plan = recorded, tmp_path / "offload.json"
    floors = offload_floors(exe, trace)  # with all optimizer state offloaded; and every master shard too
    floor = floors[0]
    budget = int(floor * ABOVE_OFFLOAD_FLOOR)
    explain = run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", f"{budget}B", "--explain"]).stdout
    on_device = size(re.search(r"optimizer state on the device \(they need at least (\S+ \S+)\)", explain).group(1))
    # Under what any schedule needs with the state on the device (the share varies with the recording:
    # 0.59 to 0.81 of it, as the optimizer's recorded temporaries do).
    assert budget < on_device, (budget, on_device)
    if masters:
        masters_floor = floors[1]
        budget = int(min(ON_DEVICE_SHARE * on_device, UNDER_STATE_FLOOR * floor))
        assert masters_floor < budget < floor, (masters_floor, budget, floor, on_device)
        run([exe, "plan", str(trace), "-o", str(plan), "--memory-budget", f"{budget}B"])
    p = json.loads(plan.read_text())
    groups = p["offload"]["optimizer_state"]
    assert groups and p["predicted"]["offload_bytes"] > 0
    assert any("master_bytes" in g for g in groups) == masters, groups
    assert p["predicted"]["peak_memory_bytes"] <= budget
    shown = run([exe, "inspect", str(plan)]).stdout
    assert re.search(r"offload: optimizer state of \d+ params on the host between steps", shown), shown
    assert bool(re.search(r"master shards of \d+ params? on the host between uses", shown)) == masters, shown
    if masters:
        refused_on_a_full_host(plan, groups)

    log = tmp_path / "offload.{rank}.jsonl"
    replayed = run(train(6), env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(log)}).stdout
    assert losses(replayed) == reference, (replayed, reference)
    # The uninterrupted replay first: a resumed run's memory means something only where the plan's held.
    checked_memory(exe, trace, plan, log, budget, p["predicted"]["peak_memory_bytes"])
    resumed_from_a_checkpoint(tmp_path, plan, p, budget, log, reference, lambda resumed_log: check_text(
        exe, trace, plan, resumed_log))


def check_text(exe, trace, plan, log):
    """`dcplan check`'s report of the 2 ranks' replay logs (log: a path with {rank}) against the plan,
    with the memory curve op by op: where a failure's memory went."""
    logs = [str(log).replace("{rank}", str(r)) for r in range(2)]
    checked = run([exe, "check", "--trace", str(trace), str(plan), *logs], env={"DCPLAN_PYTHON": sys.executable},
                  expect=None)
    check = checked.stdout + checked.stderr
    assert checked.returncode in (0, 1), check  # 1: departed or over the budget, said by the caller
    return check


def checked_memory(exe, trace, plan, log, budget, predicted):
    """Asserts that each rank of the replay logged at log followed the plan, within the budget and
    PEAK_TOLERANCE of the predicted peak (2026-11-27: a rank 1.4 MiB over in the optimizer step, in
    about one run of three: the copies of Gloo's own reduce_scatter, freed by its worker whenever it
    next ran; docs/planning.md, memory model)."""
    from dcplan import _plan

    check = check_text(exe, trace, plan, log)
    assert check.count("follows") == 2 and "OVER BUDGET" not in check, check
    for rank in range(2):
        m = _plan.measured(_plan.read_replay_log(str(log).replace("{rank}", str(rank))))
        assert m["peak_bytes"] <= budget, (rank, m["peak_bytes"], budget, check)
        assert abs(m["peak_bytes"] / predicted - 1) <= PEAK_TOLERANCE, (rank, m["peak_bytes"], predicted, check)


def resumed_from_a_checkpoint(tmp_path, plan, p, budget, log, reference, check):
    """plan's job saved after 3 steps and resumed (p: the plan; log: the uninterrupted replay's logs;
    reference: the losses without a plan; check: `dcplan check`'s report of a replay log, for a failure)."""
    from dcplan import _plan

    # A job saves after 3 steps and a new one resumes from it: what the plan keeps on the host goes
    # through the state dicts (docs/checkpoints.md). The same losses; the load, all of it before the
    # resumed job's first forward (its first mark), within the budget; the resumed job's first step
    # starts holding what an uninterrupted one holds at a step's first op, up to the scalars a load
    # makes (20 B seen; RESUMED_SLACK): through torch's load_state_dict all the optimizer state stayed on
    # the device until the step's end (19.5 MB more here, which crossed the budget); and its whole run,
    # the load included, keeps the budget and the predicted peak, as the uninterrupted one must.
    ckpt, resumed_log = tmp_path / "ckpt", tmp_path / "resumed.{rank}.jsonl"
    saved = run([*train(3), "--save", str(ckpt), "--save-at", "3"], env={"DCPLAN_PLAN": str(plan)}).stdout
    assert losses(saved) == reference[:3], (saved, reference)
    resumed_run = run([*train(6), "--resume", str(ckpt)],
                      env={"DCPLAN_PLAN": str(plan), "DCPLAN_REPLAY_LOG": str(resumed_log)})
    resumed = resumed_run.stdout
    assert "resumed from" in resumed and losses(resumed) == reference[3:], (resumed, reference)
    for rank in range(2):
        events = _plan.read_replay_log(str(resumed_log).replace("{rank}", str(rank)))
        marks = [e for e in events if e["ev"] == "mark"]
        assert marks and marks[0]["peak_bytes"] <= budget, ("the load", rank, marks[:1], budget)
        ops = [e for e in _plan.read_replay_log(str(log).replace("{rank}", str(rank))) if e["ev"] == "op"]
        steady = max(ops[k * len(ops) // 6]["mem"] for k in range(1, 6))  # each later step's first op
        first = next(e for e in events if e["ev"] == "op")["mem"]
        assert first <= steady + RESUMED_SLACK, ("resumed with more on the device", rank, first, steady)
        whole = _plan.measured(events)["peak_bytes"]
        # (CI, twice in three runs by 2026-11-28, not reproduced here in 12 runs of the case and 5
        # save/resume pairs, loaded or not: a resumed run 3.4 MiB over its prediction every step,
        # another 5.5% under it, each before the uninterrupted replay was checked; hence the check's
        # curve and the run's stderr.)
        if not (whole <= budget and abs(whole / p["predicted"]["peak_memory_bytes"] - 1) <= PEAK_TOLERANCE):
            pytest.fail(f"the resumed run: rank {rank} peaked at {whole} B (marks "
                        f"{[m['peak_bytes'] for m in marks]}), budget {budget}, predicted "
                        f"{p['predicted']['peak_memory_bytes']}:\n{check(resumed_log)}\n"
                        f"its stderr (a transport that stopped waiting for Gloo's worker warns there):\n"
                        f"{resumed_run.stderr[-3000:]}")
