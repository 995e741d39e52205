"""dcplan: profile-then-replay planning for ZeRO-style sharded data-parallel training.

``dcplan.shard(model, stage=1|2|3)`` shards a model's parameters over the ranks
of a torch.distributed group and runs it through the ``torch.ops.dc.*`` op set.
"""
import os
import pathlib

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_REPO_DIR = _PACKAGE_DIR.parent.parent


def _extension_dirs():
    env = os.environ.get("DCPLAN_BUILD_DIR")
    if env:
        return [pathlib.Path(env) / "python" / "dcplan"]
    return [_REPO_DIR / "build" / "cpu" / "python" / "dcplan", _REPO_DIR / "build" / "cuda" / "python" / "dcplan"]


def _add_extension_dir():
    for d in _extension_dirs():
        if d.is_dir():
            if str(d) not in __path__:
                __path__.append(str(d))
            return d
    return None


_EXTENSION_DIR = _add_extension_dir()

import torch  # noqa: E402  (libtorch must be loaded before the extension)

try:
    from . import _C  # noqa: E402
except ImportError as e:  # pragma: no cover - depends on the build
    searched = ", ".join(str(d) for d in _extension_dirs())
    found = f"found {_EXTENSION_DIR} but loading failed: {e}" if _EXTENSION_DIR else "no build directory found"
    raise ImportError(
        f"dcplan: the runtime extension dcplan._C is not built or cannot be loaded (searched: {searched}; "
        f"{found}). Build it with `cmake --preset cpu && cmake --build --preset cpu`, or set DCPLAN_BUILD_DIR "
        "to a build directory that has python/dcplan/_C*.so."
    ) from e

from ._shard import full_parameters, init, shard, shutdown  # noqa: E402
from ._shm import ShmFallbackWarning  # noqa: E402
from ._clip import clip_grad_norm_, install_warning as _install_clip_warning  # noqa: E402

_install_clip_warning()
from ._plan import PlanDepartureWarning, read_replay_log, replay_differences, replay_log  # noqa: E402

__all__ = ["shard", "init", "full_parameters", "shutdown", "clip_grad_norm_", "ShmFallbackWarning"]
__all__ += ["replay_log", "read_replay_log", "replay_differences", "PlanDepartureWarning"]
