"""What a LightningModule and its callbacks do with gradients, found before training starts."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_dp.comm.errors import ConfigurationError, NonFiniteGradientError

#: hooks in which a LightningModule or a callback reads or edits ``param.grad`` (``on_before_zero_grad`` sees the
#: step's gradients after the step)
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def gradient_readers(trainer: pl.Trainer, module: pl.LightningModule) -> list[str]:
    """What in this run may read or edit gradients between backward and the optimizer step: overridden gradient
    hooks of the module and of callbacks, a custom ``configure_gradient_clipping``, and manual optimization (whose
    ``training_step`` may touch ``param.grad`` between ``manual_backward`` and ``optimizer.step``). A callback with
    ``reads_gradients = False`` overrides those hooks only to observe the step (a timer) and is not counted."""
    found = [f"{type(module).__name__}.{hook}" for hook in (*GRADIENT_HOOKS, "configure_gradient_clipping")
             if is_overridden(hook, module, pl.LightningModule)]  # fmt: skip
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if getattr(callback, "reads_gradients", True) is False:
            continue
        found += [
            f"{type(callback).__name__}.{hook}" for hook in GRADIENT_HOOKS if is_overridden(hook, callback, Callback)
        ]
    if not module.automatic_optimization:
        found.append("manual optimization")
    return found


def sparse_gradient_modules(module: torch.nn.Module) -> list[str]:
    """Names of the submodules that produce sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``)."""
    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [name or type(module).__name__ for name, m in module.named_modules()
            if isinstance(m, embeddings) and m.sparse and m.weight.requires_grad]  # fmt: skip


def refuse_sparse_gradients(model: nn.Module, owner: str) -> None:
    """Raise :class:`ConfigurationError` naming ``owner`` when ``model`` produces sparse gradients (dense buckets)."""
    sparse = sparse_gradient_modules(model)
    if sparse:
        raise ConfigurationError(
            f"{owner} does not support sparse gradients, but {', '.join(sparse)} produce them (nn.Embedding / "
            "nn.EmbeddingBag with sparse=True): its gradient buckets are dense. Use sparse=False (the same updates for "
            "SGD, Adam and the other dense optimizers), or strategy='ddp' to keep sparse gradients (e.g. for "
            "torch.optim.SparseAdam)."
        )


def nonfinite_gradient_error(module: pl.LightningModule, param: Tensor | None, rank: int) -> NonFiniteGradientError:
    """The error for a NaN/inf averaged gradient at ``module``'s current step, naming ``param`` (seen on ``rank``)."""
    names = {id(p): n for n, p in module.named_parameters()}
    where = f" (rank {rank} saw it in parameter {names.get(id(param), '?')!r})" if param is not None else ""
    return NonFiniteGradientError(
        f"non-finite (NaN or infinite) averaged gradient at global step {module.global_step}{where}; every rank "
        "stops here, before the optimizer step, so the weights are still finite"
    )
