"""The step of the parameter-server schemes: servers run the optimizer, every rank pulls the new weights."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_dp._lightning_compat import after_closure, unwrap_optimizer
from lightning_dp.comm.buckets import GradientBucket
from lightning_dp.comm.errors import ConfigurationError
from lightning_dp.comm.nonfinite import first_nonfinite
from lightning_dp.comm.ring import Ring, any_rank
from lightning_dp.strategies.base import DataParallelStrategy
from lightning_dp.strategies.inspection import gradient_readers

#: optimizers that re-evaluate the closure within one step; a server cannot re-run the workers' forward passes
CLOSURE_OPTIMIZERS = (torch.optim.LBFGS,)


class ParameterServerBase(DataParallelStrategy):
    """Shared step logic of the parameter-server schemes: servers run the optimizer, every rank pulls weights.

    A step is: the closure (forward, backward; gradients are pushed to their servers bucket by bucket during
    backward), Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, a vote on NaN/inf, then
    :meth:`_server_update` and the pull of the new weights over the transport. Ranks that serve nothing never
    call the optimizer, so they hold no optimizer state.

    When nothing in the run reads gradients between backward and the step
    (:func:`~lightning_dp.strategies.inspection.gradient_readers`), only a server holds averaged gradients, and
    only for what it serves; ``param.grad`` elsewhere keeps the local gradient. Otherwise (:attr:`full_gradients`)
    the servers also send the averaged gradients back, so that every rank's hooks see and edit exactly what they
    would see under DDP, and the servers step with the edited gradients: the central server sends ``(N - 1) S``
    more bytes per step, a sharded server ``(N - 1) / N S``.

    A subclass provides the transport, :meth:`_server_gradients` and :meth:`_server_update`, and may take the
    averaged gradients into the server's optimizer in :meth:`_gradients_before_hooks` /
    :meth:`_gradients_after_hooks`.
    """

    _every_rank_steps = False

    @override
    def _gradients_everywhere(self, trainer: pl.Trainer) -> bool:
        assert self.lightning_module is not None and self.gradient_group is not None
        readers = gradient_readers(trainer, self.lightning_module)
        # every rank must send the same messages: one rank's reader (a callback added on rank 0 only) decides for all
        anyone = any_rank(bool(readers), Ring(self.gradient_group), self.root_device)
        if readers:
            rank_zero_info(
                f"{self.strategy_name}: every rank receives the averaged gradients after backward (more traffic per "
                f"step) because gradients are read or edited before the optimizer step by: {', '.join(readers)}"
            )
        return anyone

    @override
    def _check_optimizers(self) -> None:
        for optimizer in map(unwrap_optimizer, self.optimizers):
            if isinstance(optimizer, CLOSURE_OPTIMIZERS):
                raise ConfigurationError(
                    f"strategy {self.strategy_name!r} cannot run optimizer {type(optimizer).__name__}: it "
                    "re-evaluates the closure several times per step, which only the rank running forward can do. "
                    "Use a per-parameter optimizer (SGD, Adam, AdamW, ...) or strategy='ring_allreduce'."
                )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ConfigurationError(
                f"strategy {self.strategy_name!r} does not support precision='16-mixed' (its gradient scaler "
                "would need to run on the servers); use precision='bf16-mixed' or '32-true'."
            )

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        optimizer = unwrap_optimizer(optimizer)
        self._check_trainable_unchanged(optimizer)
        result = closure()
        self._gradients_before_hooks(optimizer)
        after_closure(self.precision_plugin, model, optimizer)  # on_before_optimizer_step hooks, clipping
        self._gradients_after_hooks(optimizer)
        self._check_server_gradients(optimizer)
        assert self.transport is not None
        for bucket in self._buckets_of(optimizer):  # a codec may keep the owners' weights apart (16-bit replicas)
            self.codec.before_update(bucket, self.transport)
        self._server_update(optimizer, **kwargs)
        start = time.perf_counter()
        self._pull(optimizer)
        self._end_step(blocking_seconds=time.perf_counter() - start)
        return result

    def _gradients_before_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the averaged gradients to the servers' update before ``on_before_optimizer_step`` (subclasses)."""

    def _gradients_after_hooks(self, optimizer: torch.optim.Optimizer) -> None:
        """Or after it and clipping, when the servers must step with gradients the hooks edited (subclasses)."""

    def _server_gradients(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        """``(parameter, averaged gradient)`` pairs this rank serves for ``optimizer``'s step."""
        raise NotImplementedError

    def _check_server_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Only servers see averaged gradients: they vote (one tiny all-reduce) so every rank decides alike."""
        assert self.transport is not None
        bad = first_nonfinite(self._server_gradients(optimizer))
        if any_rank(bad is not None, self.transport.ring, self.root_device):
            self._raise_nonfinite(bad)

    def _server_update(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """Run the servers' optimizer step for ``optimizer`` on this rank (if it serves any of its parameters)."""
        raise NotImplementedError

    def _pull(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank receives the new weights of ``optimizer``'s parameters from their servers."""
        assert self.transport is not None
        for bucket in self._buckets_of(optimizer):
            start, end = self.transport.owned(bucket)
            bucket.pack_params(start, end)
            self.codec.share_weights(bucket, self.transport)
            if self.codec.rewrites_weights or not self.transport.owns_all(bucket):
                bucket.unpack_params()

    @override
    def _exchange_weights(self) -> None:
        for optimizer in self.optimizers:
            self._pull(unwrap_optimizer(optimizer))

    def _buckets_of(self, optimizer: torch.optim.Optimizer) -> list[GradientBucket]:
        """The buckets holding any parameter of ``optimizer`` (only those need new weights after its step)."""
        assert self.reducer is not None
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [b for b in self.reducer.buckets if any(id(p) in ids for p in b.params)]
