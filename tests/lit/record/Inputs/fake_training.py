#!/usr/bin/env python3
"""Stands in for a training job under `dcplan record`: follows the recording protocol
of docs/recording.md (DCPLAN_RECORD, progress files, rank traces) without torch.

fake_training.py MODE [--world-size N]
  ok            record the steps, write one trace per rank, exit 0
  warn          like ok, with a warning of the recorder among its output
  diverge       like ok, but rank 1 reduces another parameter at one position
  missing-rank  like ok, but the last rank writes no trace
  fail          print a traceback-like message and exit 3
  fail-buried   print an error, then 25 lines of a launcher's report (as torchrun ends a failed
                job), and exit 1
  never         train without ever turning recording on, exit 0
  one-short     record every step, then end before the forward at which a rank writes its trace
  hang          start recording, then never finish (for interruption tests)
"""
import argparse
import copy
import json
import os
import pathlib
import sys
import time

BASE = pathlib.Path(__file__).resolve().parents[2] / "Inputs" / "minimal.trace.json"


def atomic_write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    print(f"fake training: mode {args.mode}, {args.world_size} ranks", flush=True)
    if args.mode == "fail":
        print("Traceback (most recent call last):\n  File \"train.py\", line 7\nRuntimeError: CUDA out of memory",
              flush=True)
        return 3
    if args.mode == "fail-buried":
        print("[rank0]: ValueError: --hidden 192 is not divisible by --heads 5", flush=True)
        for k in range(25):
            print(f"launcher report line {k}: error_file: <N/A>", flush=True)
        return 1
    record_dir = os.environ.get("DCPLAN_RECORD")
    if args.mode == "never" or not record_dir:
        print("trained 5 steps without dcplan", flush=True)
        return 0
    out = pathlib.Path(record_dir)
    steps = int(os.environ["DCPLAN_RECORD_STEPS"])
    for step in range(1, steps + 1):
        for rank in range(args.world_size):
            atomic_write(out / f"rank{rank}.progress", f"{step} {steps} {args.world_size}\n")
        print(f"step {step}", flush=True)
        time.sleep(0.05)
        if args.mode == "hang":
            while True:
                time.sleep(1)
    if args.mode == "one-short":
        print("trained warm-up + recorded steps, and stopped", flush=True)
        return 0
    if args.mode == "warn":  # as torch prints a TORCH_WARN of the recorder
        print("[W1125 04:00:00.000000000 Recorder.cpp:338] Warning: record: in the device-lead step the device "
              "caught up with the host at op 3 of micro-step 0 (function deviceComputeUs)", flush=True)
    base = json.loads(BASE.read_text())
    base["meta"]["world_size"] = args.world_size
    for p in base["params"]:
        p["shard_numel"] = -(-p["numel"] // args.world_size)
    for rank in range(args.world_size):
        if args.mode == "missing-rank" and rank == args.world_size - 1:
            continue
        trace = copy.deepcopy(base)
        for event in trace["steps"][0]["graphs"][1]["events"]:
            event["end_us"] += rank  # later ranks are slower: the merge keeps the max
        if args.mode == "diverge" and rank == 1:
            trace["steps"][0]["graphs"][1]["events"][3]["ds_id"] = 0
        atomic_write(out / f"rank{rank}.trace.json", json.dumps(trace, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
