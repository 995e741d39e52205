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
    """In a checkout (PYTHONPATH=python), the build directory that holds the extension; an
    installed package (pip install .) has it beside this file and searches nothing else."""
    if any(_PACKAGE_DIR.glob("_C.*")):
        return _PACKAGE_DIR
    for d in _extension_dirs():
        if d.is_dir():
            if str(d) not in __path__:
                __path__.append(str(d))
            return d
    return None


_EXTENSION_DIR = _add_extension_dir()

import torch  # noqa: E402  (libtorch must be loaded before the extension)


def _check_torch_release() -> None:
    """The extension runs only with the torch release it was built against (torch's C++ ABI
    changes between releases; a mismatch would crash or misbehave far from here)."""
    try:
        from . import _build_info
    except ImportError:  # a build from before _build_info existed: nothing to compare
        return
    built, running = _build_info.TORCH_VERSION, torch.__version__
    if built.split("+")[0].split(".")[:2] != running.split("+")[0].split(".")[:2]:
        raise ImportError(
            f"dcplan: dcplan._C was built against torch {built}, but this process imports torch {running}; "
            "rebuild dcplan against this torch: pip install --force-reinstall --no-deps . (from the dcplan "
            "checkout), or configure and build the CMake build directory again (cmake --preset cpu)"
        )


_check_torch_release()
try:
    from . import _C  # noqa: E402
except ImportError as e:  # pragma: no cover - depends on the build
    searched = ", ".join(str(d) for d in [_PACKAGE_DIR] + _extension_dirs())
    found = f"found {_EXTENSION_DIR} but loading failed: {e}" if _EXTENSION_DIR else f"not found ({e})"
    raise ImportError(
        f"dcplan: the runtime extension dcplan._C is not built or cannot be loaded (searched: {searched}; "
        f"{found}). Install dcplan with `pip install .` from its checkout, or build it with "
        "`cmake --preset cpu && cmake --build --preset cpu` and set DCPLAN_BUILD_DIR to that build directory."
    ) from e

from ._shard import full_parameters, init, shard, shutdown  # noqa: E402
from ._shm import ShmFallbackWarning  # noqa: E402
from ._graphed import GraphedStep, graphed_step  # noqa: E402
from ._clip import clip_grad_norm_, install_warning as _install_clip_warning  # noqa: E402

_install_clip_warning()
from ._shard_param import ShardParameter  # noqa: E402
from ._state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,  # noqa: E402
                          set_model_state_dict, set_optimizer_state_dict)
from ._plan import (  # noqa: E402
    BudgetGuardWarning, InputShapeWarning, PlanDepartureWarning, curve_comparison, read_replay_log,
    replay_differences, replay_log)

from . import _after_import  # noqa: E402

# Trainer(strategy="dcplan"): registered once Lightning is imported, before or after dcplan.
_after_import.after_import("lightning.pytorch", lambda: __import__("dcplan.lightning"))

__all__ = ["shard", "init", "full_parameters", "shutdown", "clip_grad_norm_", "ShmFallbackWarning", "graphed_step",
           "GraphedStep"]
__all__ += ["StateDictOptions", "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
            "set_optimizer_state_dict"]
__all__ += ["ShardParameter"]
__all__ += ["replay_log", "read_replay_log", "replay_differences", "curve_comparison", "PlanDepartureWarning",
            "BudgetGuardWarning", "InputShapeWarning"]
