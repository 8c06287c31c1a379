"""Which hooks between two optimizer steps may read the weights, and completing the servers' pull before them.

Under the overlapped pull (:class:`~lightning_dp.comm.weight_pull.OverlappedPull`) a parameter holds the weights of
the last step only from its module's next forward on. A callback or the LightningModule that reads weights in a
hook between the step and that forward (an EMA of the weights in ``on_train_batch_end``, a weight histogram) must
see them complete: :class:`CompleteWeightsBefore`, the first callback of the trainer, completes the pull before
those hooks run. Lightning's own callbacks read no weights there, and neither does a callback that declares
``reads_weights = False``; they never delay the pull. It also completes the pull before any callback's or the
module's ``on_validation_start`` and ``on_train_end``; checkpoints complete it on their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

#: the hooks that run between an optimizer step and the next forward, or inside the closure before backward
WEIGHT_HOOKS = ("on_train_batch_end", "on_train_epoch_end", "on_train_epoch_start", "on_train_batch_start",
                "on_before_zero_grad")  # fmt: skip

#: hooks before which the pull always completes: validation and the end of training read the weights, and Lightning
#: calls the strategy's own hooks there only after the callbacks' and the module's
ALWAYS_COMPLETE_BEFORE = ("on_validation_start", "on_train_end")

#: Lightning's callbacks that read no weights in :data:`WEIGHT_HOOKS` (a checkpoint they save completes the pull
#: itself); a subclass's own override of such a hook still counts
WEIGHT_BLIND_CALLBACKS: tuple[type[Callback], ...] = (
    ProgressBar, ModelCheckpoint, LearningRateMonitor, ModelSummary, Timer, EarlyStopping, DeviceStatsMonitor,
)  # fmt: skip


def _overrides(hook: str, obj: Any, base: type) -> bool:
    """Whether ``obj`` overrides ``hook`` of ``base`` with code of its own: Lightning's weight-blind callbacks (their
    own subclasses, such as ``TQDMProgressBar``, included) do not count, a user's subclass overriding the hook does."""
    if not is_overridden(hook, obj, base):
        return False
    owner = next(cls for cls in type(obj).__mro__ if hook in vars(cls))
    lightnings = owner.__module__.startswith(("lightning.", "pytorch_lightning."))
    return not (lightnings and issubclass(owner, WEIGHT_BLIND_CALLBACKS))


def weight_readers(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, list[str]]:
    """Per hook of :data:`WEIGHT_HOOKS`, the callbacks and the module that override it and may read weights in it
    (class names; hooks nothing overrides are left out). ``reads_weights = False`` on a callback or the module
    says it does not."""
    readers: dict[str, list[str]] = {}
    candidates: list[tuple[Any, type]] = [(c, Callback) for c in trainer.callbacks]  # type: ignore[attr-defined]
    candidates.append((module, pl.LightningModule))
    for obj, base in candidates:
        if getattr(obj, "reads_weights", True) is False or isinstance(obj, CompleteWeightsBefore):
            continue
        for hook in WEIGHT_HOOKS:
            if _overrides(hook, obj, base):
                readers.setdefault(hook, []).append(type(obj).__name__)
    return readers


class CompleteWeightsBefore(Callback):
    """Completes the servers' weight pull (``complete``) before the hooks in ``readers`` and
    :data:`ALWAYS_COMPLETE_BEFORE` run on any callback or the module: installed as the trainer's first callback, it
    runs before all of them."""

    reads_gradients = False
    reads_weights = False

    def __init__(self, complete: Callable[[], None], readers: dict[str, list[str]]) -> None:
        self._complete = complete
        #: the reader hooks (the pull completes early for them) and the hooks before which it always completes
        self.reader_hooks = frozenset(readers)
        self.hooks = self.reader_hooks | frozenset(ALWAYS_COMPLETE_BEFORE)
        self._trainer: pl.Trainer | None = None

    def install(self, trainer: pl.Trainer) -> None:
        """Become ``trainer``'s first callback."""
        trainer.callbacks.insert(0, self)  # type: ignore[attr-defined]
        self._trainer = trainer

    def remove(self) -> None:
        """Leave the trainer's callbacks as they were."""
        if self._trainer is not None and self in self._trainer.callbacks:  # type: ignore[attr-defined]
            self._trainer.callbacks.remove(self)  # type: ignore[attr-defined]
        self._trainer = None

    def _before(self, hook: str) -> None:
        if hook in self.hooks:
            self._complete()

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_train_batch_start")

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_train_batch_end")

    def on_train_epoch_start(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_train_epoch_start")

    def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_train_epoch_end")

    def on_before_zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_before_zero_grad")

    def on_validation_start(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_validation_start")

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self._before("on_train_end")
