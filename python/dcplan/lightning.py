"""dcplan as a Lightning strategy: ``Trainer(strategy="dcplan")``, or
``Trainer(strategy=DcplanStrategy(stage=2, param_dtype=torch.bfloat16, plan="plan.json"))``.

Importing dcplan registers the name "dcplan" with ``lightning.pytorch``'s StrategyRegistry once
Lightning is imported (before or after dcplan); importing this module registers it at once.

What it does, where Lightning's DDP strategy would wrap the module in DDP:
- ``setup``: ``dcplan.shard(lightning_module, ...)`` before ``configure_optimizers``, so the
  optimizer is built on the shards;
- every ``*_step`` runs through the module's forward (Lightning's forward redirection), so
  dcplan's step hooks see each step;
- gradient accumulation: the micro-steps before the boundary run with
  ``set_requires_gradient_sync(False)``;
- ``gradient_clip_val`` (norm): ``dcplan.clip_grad_norm_``, the norm over every rank;
- checkpoints: a directory, as Lightning's ModelParallelStrategy (FSDP2) writes it: DCP files
  of ``{"state_dict": ..., "optimizer_0": ...}`` in the original shapes, and ``meta.pt`` with
  the rest (loops, callbacks, schedulers).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from . import _shard, _state_dict
from ._clip import clip_grad_norm_

NAME = "dcplan"
_META = "meta.pt"  # the checkpoint's non-tensor state, as Lightning's ModelParallelStrategy names it


class _DcplanPrecision(Precision):
    """Lightning's fp32 precision (dcplan casts to param_dtype itself) whose norm clipping is
    dcplan's: the norm over every rank's shards, not this rank's."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._module = module

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_grad_norm_(self._module, float(clip_val))


class DcplanStrategy(DDPStrategy):
    """Trains the LightningModule sharded by ``dcplan.shard`` (ZeRO ``stage`` 1, 2 or 3).

    ``param_dtype``, ``reduce_dtype``, ``plan``, ``compile``: as ``dcplan.shard``'s. Leave the
    Trainer's ``precision`` at "32-true": dcplan computes in ``param_dtype`` and keeps fp32
    master shards. ``process_group_backend``, ``timeout``, ``start_method``: as DDPStrategy's.
    """

    strategy_name = NAME

    def __init__(self, stage: int = 3, param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None, plan=None, compile=False, *,
                 process_group_backend: Optional[str] = None, start_method: str = "popen", **lightning_args):
        # lightning_args: what Lightning itself passes (accelerator, parallel_devices, timeout, ...);
        # DDP's own keyword arguments would reach DistributedDataParallel, which dcplan replaces.
        unknown = sorted(set(lightning_args) - _LIGHTNING_ARGS)
        if unknown:
            raise TypeError(f"DcplanStrategy: unexpected arguments {unknown} (dcplan's: stage, param_dtype, "
                            f"reduce_dtype, plan, compile; Lightning's: {sorted(_LIGHTNING_ARGS)})")
        super().__init__(process_group_backend=process_group_backend, start_method=start_method, **lightning_args)
        self._shard_args = {"stage": stage, "param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "plan": plan,
                            "compile": compile}

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description="dcplan: ZeRO-1/2/3 sharding with planned communication")

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self._use_dcplan_precision()
        self.model_to_device()
        module = self.lightning_module
        if getattr(module, "_dcplan", None) is None:  # a second fit() or validate() keeps the shards
            _shard.shard(module, **self._shard_args)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # configure_optimizers() sees the shards
        self.setup_precision_plugin()

    def _use_dcplan_precision(self) -> None:
        if type(self.precision_plugin) not in (Precision, _DcplanPrecision):
            raise ValueError(
                f"DcplanStrategy: Trainer(precision=...) chose {type(self.precision_plugin).__name__}; dcplan "
                "computes in param_dtype with fp32 master shards: leave precision at '32-true' and pass "
                "DcplanStrategy(param_dtype=torch.bfloat16)")
        self.precision_plugin = _DcplanPrecision(self.lightning_module)

    def teardown(self) -> None:
        """Lightning's own moves the module and its optimizers' state to the CPU; the shards'
        storage is dcplan's runtime's and stays on its device (a move would be refused)."""
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- steps ----------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            return self._through_forward("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.val_step_context():
            return self._through_forward("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self._through_forward("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self._through_forward("predict_step", *args, **kwargs)

    def _through_forward(self, method: str, *args: Any, **kwargs: Any):
        """module.<method>(...) called as the module's forward: the sharded root's hooks open and
        close the step around it (a forward the method calls inside is nested in it)."""
        module = self.lightning_module
        return self._forward_redirection(module, module, method, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self):
        """The micro-steps before an accumulation boundary: gradients stay on their rank."""
        module = self.lightning_module
        module.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            module.set_requires_gradient_sync(True)

    # -- checkpoints ----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the shards, which setup() makes

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint() restores them

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return _state_dict.get_model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        return _state_dict.get_optimizer_state_dict(self.lightning_module, _unwrap(optimizer))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # load_checkpoint() loaded it

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # load_checkpoint() loaded them

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """A directory: DCP files of the model and optimizer states, and meta.pt (rank 0) with the
        rest of Lightning's checkpoint. Every rank calls it (a collective)."""
        if storage_options is not None:
            raise TypeError("DcplanStrategy.save_checkpoint: storage_options is not supported (DCP writes the files)")
        path = Path(self.broadcast(str(filepath)))
        if self.global_rank == 0:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        dcp.save(tensors, checkpoint_id=path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _META)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Loads save_checkpoint's directory into the shards and optimizers (any world size and
        stage); returns the rest of the checkpoint for Lightning to restore."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / _META).is_file():
            raise FileNotFoundError(f"DcplanStrategy.load_checkpoint: {path} is not a DcplanStrategy checkpoint "
                                    f"(a directory with DCP files and {_META})")
        module = self.lightning_module
        optimizers = [_unwrap(o) for o in self.optimizers]
        tensors = {"state_dict": _state_dict.get_model_state_dict(module)}
        tensors.update({f"optimizer_{i}": _state_dict.get_optimizer_state_dict(module, o)
                        for i, o in enumerate(optimizers)})
        dcp.load(tensors, checkpoint_id=path)
        options = _state_dict.StateDictOptions(strict=module.strict_loading)
        _state_dict.set_model_state_dict(module, tensors["state_dict"], options=options)
        for i, optimizer in enumerate(optimizers):
            _state_dict.set_optimizer_state_dict(module, optimizer, tensors[f"optimizer_{i}"])
        return torch.load(path / _META, weights_only=weights_only)


_LIGHTNING_ARGS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                   "timeout"}


def _unwrap(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


DcplanStrategy.register_strategies(StrategyRegistry)
