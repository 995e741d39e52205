"""What is allocated at a run's peak of GPU memory, and where it was allocated.

    torchrun --nproc-per-node 1 bench/gpu/memory_peak.py --out DIR -- examples/train_llama.py ARGS
    python bench/gpu/memory_peak.py --report DIR/snapshot.0.pickle

The first form runs the script (as `python SCRIPT ARGS` would) with torch's allocator history
recording from its start (Python stacks), dumps each rank's snapshot to DIR/snapshot.RANK.pickle
and prints rank 0's report. The report replays the allocations and frees in order: the live bytes
at their highest (what torch.cuda.max_memory_allocated reads: a block counts from its allocation
to its free request), the live blocks then, summed by the first frame outside torch, and the
allocations and frees around the peak."""
from __future__ import annotations

import argparse
import os
import pickle
import runpy
import sys
from collections import defaultdict

MiB = 2**20


def _site(frames) -> str:
    """The first frame outside torch's own files (where the program asked for the memory)."""
    for f in frames or []:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<") and "memory_peak.py" not in name:
            return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)" if not frames else f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']}"


def peak_report(snapshot: dict, device: int = 0, top: int = 25, around: int = 12) -> str:
    """The report of one device's trace: it must hold the run from its first allocation on (the
    history's max_entries large enough), or the live bytes start from what it missed."""
    events = snapshot["device_traces"][device]

    def replay(upto: int):
        """The live blocks after events[:upto], each event's total (None: no change), and how many
        frees were of blocks the trace never saw allocated."""
        live, total, totals, unseen = {}, 0, [], 0
        for e in events[:upto]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
            elif e["action"] == "free_requested" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
            else:
                unseen += e["action"] == "free_requested"
                totals.append(None)
                continue
            totals.append(total)
        return live, totals, unseen

    _, totals, unseen = replay(len(events))
    peak, peak_at = max(((t, i) for i, t in enumerate(totals) if t is not None), key=lambda ti: (ti[0], -ti[1]),
                        default=(0, -1))
    peak_live = replay(peak_at + 1)[0]
    lines = [f"{len(events)} events; peak {peak / MiB:.2f} MiB live at event {peak_at}"]
    if unseen:
        lines.append(f"({unseen} frees of blocks allocated before the trace begins: it lost its beginning, "
                     "and the live bytes leave those blocks out; raise --max-entries)")
    by_site = defaultdict(lambda: [0, 0])
    for e in peak_live.values():
        s = by_site[_site(e.get("frames"))]
        s[0] += e["size"]
        s[1] += 1
    lines.append(f"live at the peak, by where it was allocated (top {top}):")
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / MiB:10.2f} MiB  {n:5d} blocks  {site}")
    lines.append(f"the {around} allocations and frees before the peak and after it:")
    shown = [i for i, e in enumerate(events) if e["action"] in ("alloc", "free_requested")]
    k = shown.index(peak_at) if peak_at in shown else 0
    for i in shown[max(0, k - around):k + around + 1]:
        e = events[i]
        mark = ">" if i == peak_at else " "
        lines.append(f" {mark}{e['action']:>14} {e['size'] / MiB:9.2f} MiB stream {e.get('stream', 0):>3}  "
                     f"{_site(e.get('frames'))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="DIR", help="run the script after --, dump snapshots to DIR")
    p.add_argument("--report", metavar="PICKLE", help="print the report of a dumped snapshot")
    p.add_argument("--max-entries", type=int, default=1_000_000, help="allocator events kept")
    p.add_argument("--device", type=int, default=None,
                   help="--report: the device's trace (default: the one with the most events)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report, "rb") as f:
            snapshot = pickle.load(f)
        traces = snapshot["device_traces"]
        device = args.device if args.device is not None else max(range(len(traces)), key=lambda d: len(traces[d]))
        print(peak_report(snapshot, device=device))
        return 0
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.out or not script:
        p.error("expected --report PICKLE, or --out DIR -- SCRIPT ARGS")
    import torch

    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python", context="alloc")
    sys.argv = script
    code = 0
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.makedirs(args.out, exist_ok=True)
        rank = int(os.environ.get("RANK", 0))
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(os.path.join(args.out, f"snapshot.{rank}.pickle"), "wb") as f:
            pickle.dump(snapshot, f)
        if rank == 0:
            print(peak_report(snapshot, device=torch.cuda.current_device()), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
