"""Every private Lightning symbol lightning-dp relies on, in one place, so that a Lightning upgrade breaks here.

Tested with Lightning 2.6 (``TESTED_LIGHTNING``); ``tests/test_lightning_compat.py`` pins each symbol and the
behaviour the project relies on. Public Lightning API is imported where it is used.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.utilities.data import _update_dataloader

#: the Lightning releases the test suite runs against
TESTED_LIGHTNING = ("2.6",)

__all__ = [
    "TESTED_LIGHTNING",
    "_ChildProcessObserver",
    "_MultiProcessingLauncher",
    "_Stateful",
    "_SubprocessScriptLauncher",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_optimizers_to_device",
    "_parse_num_batches",
    "_set_num_threads_if_needed",
    "_sync_ddp_if_available",
    "_update_dataloader",
    "after_closure",
    "dump_checkpoint",
    "loaders_state",
    "next_training_batch",
    "recording_rank_starts",
    "patch_hydra_subprocess_command",
    "replace_clipping",
    "replace_sigterm_notifier",
    "replace_step_sigterm_broadcast",
    "set_loaded_checkpoint",
    "set_loaders_state",
    "trainer_of",
    "unwrap_optimizer",
    "wrap_closure_of",
]


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def after_closure(plugin: Precision, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """What Lightning runs between the closure and ``optimizer.step``: the ``on_before_optimizer_step`` hooks and
    gradient clipping."""
    plugin._after_closure(model, optimizer)


def skip_closure(closure: Any) -> None:
    """Mark Lightning's training-step closure as run without a loss: the loop then treats the batch as one whose
    ``training_step`` returned ``None`` (skipped), instead of failing because the closure never ran."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    target = getattr(closure, "__self__", closure)  # a bound method of the closure object, or the object
    if not hasattr(target, "_result"):
        raise TypeError(f"cannot skip a training step whose closure is {type(closure).__name__}")
    target._result = ClosureResult(None)


def wrap_closure_of(plugin: Precision, check: Callable[[torch.optim.Optimizer], None]) -> Callable[[], None]:
    """Make ``plugin`` call ``check(optimizer)`` after each closure it wraps has run (the backward, the hooks and
    clipping) and before the optimizer uses the gradients; returns a function restoring the plugin's own."""
    wrap_closure = type(plugin)._wrap_closure

    def checked(model: Any, optimizer: Any, closure: Callable[[], Any]) -> Any:
        result = wrap_closure(plugin, model, optimizer, closure)
        check(unwrap_optimizer(optimizer))
        return result

    plugin._wrap_closure = checked  # type: ignore[method-assign]

    def restore() -> None:
        plugin.__dict__.pop("_wrap_closure", None)

    return restore


def replace_clipping(
    plugin: Precision,
    by_norm: Callable[[torch.optim.Optimizer, float], None],
    by_value: Callable[[torch.optim.Optimizer, float], None],
) -> Callable[[], None]:
    """Make ``plugin``'s gradient clipping call ``by_norm`` / ``by_value`` (where the servers clip their shares);
    returns a function restoring the plugin's own."""
    plugin.clip_grad_by_norm = by_norm  # type: ignore[method-assign,assignment]
    plugin.clip_grad_by_value = by_value  # type: ignore[method-assign,assignment]

    def restore() -> None:
        plugin.__dict__.pop("clip_grad_by_norm", None)
        plugin.__dict__.pop("clip_grad_by_value", None)

    return restore


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or ``None`` (``module.trainer`` raises when there is none)."""
    return getattr(module, "_trainer", None)


def patch_hydra_subprocess_command(command: Callable[[int], tuple[list[str], str]]) -> None:
    """Make Lightning's popen launchers (Fabric's and the Trainer's) build a Hydra run's child-process command
    with ``command(local_rank)``. Raises ``RuntimeError`` if this Lightning has no such hook."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    modules = (fabric_launcher, pytorch_launcher)
    for module in modules:  # all checked before any is patched
        if not callable(getattr(module, "_hydra_subprocess_cmd", None)):
            raise RuntimeError(
                f"{module.__name__} has no _hydra_subprocess_cmd: this Lightning version builds Hydra child "
                f"commands differently, and lightning-dp's Hydra support (tested with Lightning "
                f"{', '.join(TESTED_LIGHTNING)}) cannot fix them"
            )
    for module in modules:
        module._hydra_subprocess_cmd = command  # type: ignore[attr-defined]


def reset_evaluation_data(trainer: Any) -> None:
    """Have the fit's validation loop set up its dataloaders again before it next runs (Lightning keeps them, and
    their lengths, for the whole fit)."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def replace_step_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> Callable[[], None]:
    """Lightning 2.6 broadcasts rank 0's SIGTERM flag before every training step
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``, a collective on the default group), so every step of every rank
    waits for rank 0. Run ``check`` there instead on ``trainer``'s loop; returns a function restoring Lightning's.
    A Lightning without that broadcast has nothing to replace."""
    loop = trainer.fit_loop.epoch_loop
    if not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        return lambda: None
    loop._broadcast_sigterm_tensor = check

    def restore() -> None:
        loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    return restore


def replace_sigterm_notifier(trainer: Any) -> Callable[[], None]:
    """Lightning 2.6's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``) also broadcasts from rank 0 on the
    default group, to be matched by the per-step broadcast that :func:`replace_step_sigterm_broadcast` removes. Give
    ``trainer``'s connector one that does what it does without the collective (stop the launcher's children once, set
    ``received_sigterm``); Lightning composes it with the other handlers when it registers them, after the strategy's
    set-up. Returns a function restoring Lightning's."""
    connector = trainer._signal_connector

    def notifier(signum: Any, frame: Any) -> None:
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                stop_restarting = getattr(launcher, "stop_restarting", None)
                if stop_restarting is not None:  # (the ranks it ends now are not started again)
                    stop_restarting()
                launcher.kill(signum)
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = notifier

    def restore() -> None:
        connector.__dict__.pop("_sigterm_notifier_fn", None)

    return restore


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """What a full checkpoint of ``trainer`` holds now, in memory (Lightning's ``_CheckpointConnector``)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def set_loaded_checkpoint(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Have ``trainer`` restore ``checkpoint`` as a checkpoint it loaded, after the strategy's set-up (with the
    strategy's ``restore_checkpoint_after_setup``): the modules, callbacks, loops, optimizers and schedulers."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def next_training_batch(trainer: Any) -> tuple[int, int]:
    """``(epoch, batch index)`` of the batch the training loop takes next, at its step boundary (before it fetches
    the batch): the batches of the epoch it has started so far."""
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready


@contextmanager
def recording_rank_starts(started: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Iterator[Callable[..., Any]]:
    """While Lightning's ``popen`` launcher starts a machine's other ranks: record the arguments of each one's
    ``subprocess.Popen`` into ``started`` (in local rank order); yields the ``Popen`` it starts them with."""
    from lightning.pytorch.strategies.launchers import subprocess_script as module

    original = module.subprocess
    popen = original.Popen

    def recording(*args: Any, **kwargs: Any) -> Any:
        started.append((args, kwargs))
        return popen(*args, **kwargs)

    shim = types.ModuleType("subprocess")
    shim.__dict__.update(original.__dict__)
    shim.Popen = recording  # type: ignore[attr-defined]
    module.subprocess = shim
    try:
        yield popen
    finally:
        module.subprocess = original


def loaders_state(trainer: Any) -> dict[str, Any]:
    """What a fit's loops hold of their loaders beside checkpoints: whether the validation loader is set up, and the
    epochs the training and validation loaders were last loaded at (``reload_dataloaders_every_n_epochs``)."""
    fit_loop = trainer.fit_loop
    val_loop = fit_loop.epoch_loop.val_loop
    return {
        "validation_ready": val_loop._combined_loader is not None,
        "train_loaded": fit_loop._last_train_dl_reload_epoch,
        "val_loaded": val_loop._last_val_dl_reload_epoch,
    }


def set_loaders_state(trainer: Any, state: dict[str, Any]) -> None:
    """Take :func:`loaders_state`'s epochs (once this process's loops have loaded their loaders)."""
    trainer.fit_loop._last_train_dl_reload_epoch = state["train_loaded"]
    trainer.fit_loop.epoch_loop.val_loop._last_val_dl_reload_epoch = state["val_loaded"]
