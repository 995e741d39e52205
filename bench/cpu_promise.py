#!/usr/bin/env python3
"""The plan's promise on 2 CPU ranks, timed: rounds of dcplan record -> plan (unconstrained, and at a
budget halfway between the least any schedule needs and the unconstrained plan's peak) -> replay with
the replay log, each plan's prediction against every rank's measured step and peak.

    python3 bench/cpu_promise.py                      # 2 rounds, 5 recorded steps (the demo's)
    python3 bench/cpu_promise.py --record-steps 2 --warmup 1 --replay-steps 6  # as the promise test runs

The model is the promise test's (examples/train_llama.py, sizes the demo does not use); the test
asserts the peaks and budgets, and this prints the step times it leaves out (docs/benchmarks.md, "CPU
ranks"). Percentages: predicted / measured - 1. Each replay runs --replay-steps steps, timed as
`dcplan check` times them (the median interval between step starts after the first). Each round's
files stay in the folder it prints. Runs from the checkout's build
(DCPLAN_BUILD_DIR, default build/cpu) with OMP_NUM_THREADS=1, one thread per rank.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ["--layers", "3", "--hidden", "192", "--heads", "6", "--seq", "96", "--vocab", "768", "--fused"]


def run(cmd, env=None):
    try:
        res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True,
                             text=True, timeout=600)
    except subprocess.TimeoutExpired:
        sys.exit(f"{' '.join(map(str, cmd))} did not end within 600 s")
    if res.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


def train(steps):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "examples" / "train_llama.py"), "--steps", str(steps), *MODEL]


def pct(predicted, measured, digits=0):
    return f"{100 * (predicted / measured - 1):+.{digits}f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record-steps", type=int, default=5, help="steps recorded after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps before the recorded ones")
    ap.add_argument("--replay-steps", type=int, default=10)
    args = ap.parse_args()
    if args.rounds < 1 or args.record_steps < 1 or args.warmup < 0 or args.replay_steps < 5:
        ap.error("--rounds and --record-steps should be >= 1, --warmup >= 0, --replay-steps >= 5 (a step is "
                 "the median of the intervals between step starts after the first: 3 of them at 5 steps)")
    build = pathlib.Path(os.environ.get("DCPLAN_BUILD_DIR", ROOT / "build" / "cpu"))
    exe = build / "bin" / "dcplan"
    if not exe.exists():
        sys.exit(f"cpu_promise: no dcplan at {exe}: build first (cmake --preset cpu && cmake --build --preset cpu)")
    os.environ.update(DCPLAN_BUILD_DIR=str(build),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")])))
    sys.path.insert(0, str(ROOT / "python"))
    from dcplan import _plan

    print(f"{args.rounds} rounds, {args.record_steps} steps recorded after {args.warmup}, "
          f"replays of {args.replay_steps} steps; train_llama.py {' '.join(MODEL)}")
    print("| round | plan | predicted step | ranks' steps | predicted peak | ranks' peaks | budget |")
    print("|---|---|---:|---|---:|---|---:|")
    for r in range(1, args.rounds + 1):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="cpu_promise."))
        print(f"round {r}: {tmp}", file=sys.stderr, flush=True)
        trace = tmp / "trace.json"
        run([exe, "record", "-o", trace, "--steps", str(args.record_steps), "--warmup", str(args.warmup), "--",
             *train(args.warmup + args.record_steps + 2)])
        run([exe, "plan", trace, "-o", tmp / "free.json"])
        free = json.loads((tmp / "free.json").read_text())
        least = free["predicted_default"]["peak_memory_bytes"]
        budget = (least + free["predicted"]["peak_memory_bytes"]) // 2
        run([exe, "plan", trace, "-o", tmp / "budget.json", "--memory-budget", f"{budget}B"])
        for name in ("free", "budget"):
            plan_file, log = tmp / f"{name}.json", tmp / f"{name}.{{rank}}.jsonl"
            run(train(args.replay_steps), env={"DCPLAN_PLAN": str(plan_file), "DCPLAN_REPLAY_LOG": str(log)})
            plan = json.loads(plan_file.read_text())
            step, peak = plan["predicted"]["step_us"], plan["predicted"]["peak_memory_bytes"]
            ranks = [_plan.measured(_plan.read_replay_log(str(log).replace("{rank}", str(k)))) for k in range(2)]
            steps = ", ".join(f"{m['step_us'] / 1e3:.1f} ms ({pct(step, m['step_us'])})" for m in ranks)
            peaks = ", ".join(f"{m['peak_bytes'] / 2**20:.2f} MiB ({pct(peak, m['peak_bytes'], 1)})" for m in ranks)
            held = "" if name == "free" else (f"{budget / 2**20:.2f} MiB, "
                                               + ("held" if all(m["peak_bytes"] <= budget for m in ranks)
                                                  else "**exceeded**"))
            print(f"| {r} | {name} | {step / 1e3:.1f} ms | {steps} | {peak / 2**20:.2f} MiB | {peaks} | {held} |",
                  flush=True)


if __name__ == "__main__":
    main()
