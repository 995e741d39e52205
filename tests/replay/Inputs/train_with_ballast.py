"""examples/train_llama.py on ranks that hold memory its recording did not: after dcplan.shard()
rank $BALLAST_RANK (default: every rank) allocates $BALLAST_BYTES and keeps them to the end (as a
harness keeping an EMA copy or a metrics buffer beside the model would), so that a plan made from
the recording expects less memory in use than there is. Same arguments as train_llama.py."""
import os
import sys

import torch

import dcplan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples"))
import train_llama  # noqa: E402

_shard = dcplan.shard
_kept = []


def _shard_then_hold(*args, **kwargs):
    model = _shard(*args, **kwargs)
    device = next(model.parameters()).device
    rank = os.environ.get("BALLAST_RANK")
    if rank is None or int(rank) == int(os.environ.get("RANK", 0)):
        _kept.append(torch.ones(int(os.environ["BALLAST_BYTES"]), dtype=torch.uint8, device=device))
    return model


dcplan.shard = _shard_then_hold

if __name__ == "__main__":
    sys.exit(train_llama.main())
