"""torchrun --nproc-per-node N -m dcplan.measure_network -o net.json: the collectives where a job will run.

Times all-gather, reduce-scatter and all-reduce on the N ranks of the launch, over the transport
dcplan.shard would train with (NCCL on GPUs, Gloo on CPU ranks), without a model, and writes a
dcplan.network/v1 file (rank 0). `dcplan plan TRACE --network net.json` plans a trace recorded at
another world size (one rank, say) for these N ranks with these times (docs/planning.md, "What-if").
"""
import argparse
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

from . import _C, _shard


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dcplan.measure_network", description=__doc__.split("\n\n")[1])
    p.add_argument("-o", "--output", required=True, help="the dcplan.network/v1 file to write (rank 0)")
    p.add_argument("--seconds", type=float, default=3.0,
                   help="time the measurement may take, agreed by the ranks (default 3, as a recording's)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where the buffers live (default: cuda where torch sees a GPU, else cpu)")
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds should be > 0, got {args.seconds}")
    return args


def device_of(choice):
    if (choice or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        return torch.device("cpu"), "cpu"
    if not torch.cuda.is_available():
        raise SystemExit("dcplan.measure_network: --device cuda, but torch sees no GPU")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    return device, torch.cuda.get_device_name(device)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("dcplan.measure_network: run it under torchrun on the ranks to measure, e.g. "
                         "torchrun --nproc-per-node 2 -m dcplan.measure_network -o net.json")
    device, name = device_of(args.device)
    output = pathlib.Path(args.output)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        pg = dist.group.WORLD
        if pg.size() < 2:
            raise SystemExit("dcplan.measure_network: 1 rank has no collectives to measure; launch 2 or more")
        # Rank 0 writes the file: it says before the measurement whether it can, and every rank stops alike.
        problem = [unwritable(output) if pg.rank() == 0 else None]
        dist.broadcast_object_list(problem, group=pg, group_src=0)
        if problem[0]:
            raise SystemExit(f"dcplan.measure_network: -o {args.output}: {problem[0]}")
        # Without the ranks' agreement on each collective (a Gloo call of its own per collective on CPU
        # ranks): the times are the collectives' alone, as a recording's calibration takes them.
        _shard._init_runtime(pg, device, _shard._DEFAULT_BUCKET_BYTES, check_collectives=False)
        try:
            if pg.rank() == 0:
                print(f"dcplan.measure_network: timing the collectives of {pg.size()} ranks ({name}) "
                      f"for up to {args.seconds:g} s", flush=True)
            # Rank 0 writes the file (schemas::writeFileAtomically: no partial file, whatever fails).
            text = _C.measure_network(args.seconds, str(device), name, str(output) if pg.rank() == 0 else "")
        finally:
            _C.cleanup()
        if pg.rank() == 0:
            print(f"dcplan.measure_network: wrote {args.output}", flush=True)
            for line in summary(json.loads(text)):
                print("  " + line, flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def summary(doc):
    """One line per collective: its sizes and time at the largest (on a GPU also on the device alone,
    as a CUDA graph's plan charges it: device_us, docs/formats.md)."""
    for name, curve in doc["calibration"].items():
        if not isinstance(curve, list) or not curve:
            continue
        last = curve[-1]
        on_device = f" ({last['device_us'] / 1e3:.3f} ms on the device alone)" if "device_us" in last else ""
        yield (f"{name}: {len(curve)} sizes up to {last['bytes'] / 2**20:.2f} MiB, "
               f"{last['us'] / 1e3:.3f} ms there{on_device}")


def unwritable(path: pathlib.Path):
    """Why the file cannot be written there, or None."""
    parent = path.parent
    if not parent.is_dir():
        return f"no directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {parent} is not writable"
    if path.is_dir():
        return "a directory"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
