"""Settings of the shared-memory all-reduce (``DCPLAN_SHM``, ``DCPLAN_SHM_DIR``,
``DCPLAN_SHM_TIMEOUT``) and the warning when the ranks cannot use it."""
from __future__ import annotations

import math
import os
import warnings
from typing import Dict


class ShmFallbackWarning(UserWarning):
    """The inference all-reduce goes through the process group: the ranks do not share one machine's memory."""


_DEFAULT_TIMEOUT_S = 300.0


def settings() -> Dict:
    """The keyword arguments of ``_C.init`` that the environment sets; ValueError naming a bad variable."""
    mode = os.environ.get("DCPLAN_SHM", "auto").strip().lower()
    if mode not in ("auto", "off"):
        raise ValueError(f"DCPLAN_SHM should be 'auto' or 'off', got {os.environ['DCPLAN_SHM']!r}")
    directory = os.environ.get("DCPLAN_SHM_DIR", "/dev/shm")
    if not directory:
        raise ValueError("DCPLAN_SHM_DIR should be a directory (a tmpfs shared by the ranks), got ''")
    raw = os.environ.get("DCPLAN_SHM_TIMEOUT", str(_DEFAULT_TIMEOUT_S))
    try:
        timeout = float(raw)
    except ValueError:
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"DCPLAN_SHM_TIMEOUT should be a positive number of seconds, got {raw!r}")
    return {"shm": mode == "auto", "shm_dir": directory.rstrip("/") or "/", "shm_timeout_s": timeout}


def report(reason: str) -> None:
    """Warns (once per runtime start) why the inference all-reduce uses the process group."""
    if reason and reason != "DCPLAN_SHM=off":
        warnings.warn(f"dcplan: {reason}", ShmFallbackWarning, stacklevel=4)
