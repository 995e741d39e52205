#!/usr/bin/env python3
"""The small reports of `run_on_box.sh predict`: a plan's prediction against the example's own
step lines, and the plan options to plan a trace again. One subcommand each:

    predict_report.py bench-peak RESULTS MODE           # a mode's measured peak (bytes) in the bench's --json
    predict_report.py default-budget PLAN               # a budget for the default schedule's predicted peak
    predict_report.py budget FRACTION PLAN              # FRACTION x the plan's predicted peak, in bytes
    predict_report.py one-run STEPS PLAN                # one run's median step against the prediction
    predict_report.py rounds NAME PLAN STEPS...         # every round's median, the peak, against the plan
    predict_report.py plan-args PLAN                    # the plan's strategy and budget as dcplan plan options
    predict_report.py strip-op-device TRACE OUT         # the trace without op_device_us
    predict_report.py with-without NAME PLAN PLAN_WITHOUT   # one plan predicted with and without op_device_us

STEPS files hold train_llama.py's rank-0 lines: "step   4  loss 10.1  65.2 ms" and
"peak memory: N bytes ...". A run's step time is the median of its steps from the fifth on
(the first four hold warm-up and the allocator's growth).
"""
import json
import statistics
import sys

FIRST_TIMED_STEP = 4


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"predict_report.py: {path}: {e}")


def predicted(plan_path, section="predicted", fields=("step_us", "peak_memory_bytes")):
    """A plan's prediction (or its predicted_default), with the fields the reports read."""
    p = load(plan_path).get(section, {})
    if any(f not in p for f in fields):
        sys.exit(f"predict_report.py: {plan_path}: expected " + " and ".join(f"{section}.{f}" for f in fields))
    return p


def step_times(path):
    """The example's step times (ms) in a STEPS file, from the first timed step on."""
    try:
        with open(path) as f:
            times = [float(line.split()[-2]) for line in f if line.startswith("step ")]
    except OSError as e:
        sys.exit(f"predict_report.py: {path}: {e} (did the run fail?)")
    if len(times) <= FIRST_TIMED_STEP:
        sys.exit(f"predict_report.py: {path}: expected more than {FIRST_TIMED_STEP} 'step' lines, "
                 f"found {len(times)} (did the run fail?)")
    return times[FIRST_TIMED_STEP:]


def peaks(path):
    """The allocator peaks (bytes) a STEPS file reports."""
    with open(path) as f:
        return [int(line.split()[2]) for line in f if line.startswith("peak memory")]


def percent(measured, expected):
    return f"{100 * (measured / expected - 1):+.1f}%"


def main(argv):
    if not argv:
        sys.exit(__doc__)
    cmd, args = argv[0], argv[1:]
    if cmd == "bench-peak" and len(args) == 2:
        try:
            print(load(args[0])["results"][args[1]]["peak_bytes"])
        except KeyError:
            sys.exit(f"predict_report.py: {args[0]}: expected results.{args[1]}.peak_bytes (did that mode run?)")
    elif cmd == "default-budget" and len(args) == 1:
        # The planner keeps 0.5% of a budget back for what it does not see (kUnseenReserveShare).
        default = predicted(args[0], "predicted_default", ("peak_memory_bytes",))
        print(int(default["peak_memory_bytes"] / 0.995) + 1)
    elif cmd == "budget" and len(args) == 2:
        print(int(float(args[0]) * predicted(args[1])["peak_memory_bytes"]))
    elif cmd == "one-run" and len(args) == 2:
        ms = step_times(args[0])
        pred = predicted(args[1])["step_us"] / 1e3
        median = statistics.median(ms)
        print(f"  without the log: {median:.3f} ms ({percent(median, pred)} against the predicted {pred:.3f} ms; "
              f"median of {len(ms)} steps, rank 0)")
    elif cmd == "rounds" and len(args) >= 3:
        name, plan, files = args[0], predicted(args[1]), args[2:]
        rounds = [statistics.median(step_times(f)) for f in files]
        pred, median = plan["step_us"] / 1e3, statistics.median(rounds)
        line = (f"{name:>14}: predicted {pred:.1f} ms, measured {median:.1f} ms ({percent(median, pred)}), "
                f"rounds {' '.join(f'{r:.1f}' for r in rounds)}")
        measured_peaks = [p for f in files for p in peaks(f)]
        if measured_peaks:
            want, got = plan["peak_memory_bytes"], max(measured_peaks)
            line += (f", peak predicted {want / 2**30:.2f} GiB, measured {got / 2**30:.2f} GiB "
                     f"({percent(got, want)})")
        print(line)
    elif cmd == "plan-args" and len(args) == 1:
        options = load(args[0]).get("options", {})
        if "strategy" not in options:
            sys.exit(f"predict_report.py: {args[0]}: expected options.strategy in the plan")
        out = ["--strategy", options["strategy"]]
        if options.get("memory_budget_bytes"):
            out += ["--memory-budget", str(options["memory_budget_bytes"])]
        print(" ".join(out))
    elif cmd == "strip-op-device" and len(args) == 2:
        trace = load(args[0])
        for step in trace["steps"]:
            for graph in step["graphs"]:
                for event in graph["events"]:
                    event.pop("op_device_us", None)
        with open(args[1], "w") as f:
            json.dump(trace, f)
    elif cmd == "with-without" and len(args) == 3:
        with_it, without = (predicted(p)["step_us"] / 1e3 for p in args[1:3])
        print(f"{args[0]:>14}: predicted {without:.1f} ms without op_device_us, {with_it:.1f} ms with it")
    else:
        sys.exit(f"predict_report.py: unknown subcommand or wrong arguments: {' '.join(argv)}\n\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
