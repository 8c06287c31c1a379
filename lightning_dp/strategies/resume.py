"""Exact mid-epoch resume: the resumed epoch continues with exactly the batches an uninterrupted run would see.

Lightning restores the loops of a mid-epoch checkpoint at the right step, but a plain ``DataLoader`` starts the
epoch over, so the resumed run trains the epoch's first batches twice and its last ones never (Lightning warns:
"your dataloader is not resumable"). Where Lightning put its own ``DistributedSampler`` into the training loader
(``use_distributed_sampler=True``, a map-style dataset batched by a plain ``BatchSampler``), the strategy swaps it,
for the resumed epoch only, for :class:`ResumingDistributedSampler`: the same epoch's permutation, starting after
the indices of the batches the checkpoint already trained, so the skipped samples are never loaded. Every later
epoch runs as before.

Not covered (Lightning's warning stays): a sampler or batch sampler of the user's own, an ``IterableDataset``,
and randomness inside the data pipeline (augmentations in worker processes draw from their own generators). A
loader with its own ``state_dict`` is left to Lightning, which restores it. Several training loaders each skip
the batches already trained, which is right in the modes that draw one batch from every loader per step, until a
shorter loader has cycled (then it restarts its epoch, as without resume).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_dp._lightning_compat import _parse_num_batches, _Stateful, _update_dataloader


class ResumingDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose first iteration in epoch ``epoch`` leaves out its first ``skip`` indices.

    ``len()`` stays the full epoch's (Lightning counts the resumed epoch's batches from where the checkpoint left
    it); the iteration is short by ``skip`` indices, exactly the batches already trained."""

    def __init__(self, base: DistributedSampler, epoch: int, skip: int) -> None:
        super().__init__(
            base.dataset, num_replicas=base.num_replicas, rank=base.rank, shuffle=base.shuffle, seed=base.seed,
            drop_last=base.drop_last,
        )  # fmt: skip
        self.set_epoch(epoch)
        self.resume_epoch = epoch
        self.skip = skip

    def __iter__(self) -> Any:
        indices = list(super().__iter__())
        if self.skip and self.epoch == self.resume_epoch:
            indices = indices[self.skip :]
        self.skip = 0  # the next iteration, this epoch again or a later one, is whole
        return iter(indices)


def batches_already_trained(trainer: pl.Trainer) -> int:
    """How many batches of the current epoch a restored checkpoint has trained, as Lightning's loop will count
    them when it resumes (0 when not resuming, or resuming at an epoch boundary)."""
    fit_loop = trainer.fit_loop
    if not fit_loop.restarting:
        return 0
    epoch_loop = fit_loop.epoch_loop
    epoch_loop.update_restart_stage()  # what the loop's reset will compute from the same counters
    # a checkpoint written in on_train_batch_end has not yet counted its batch as completed
    return epoch_loop.batch_progress.current.completed + int(epoch_loop.restarted_on_train_batch_end)


def resume_mid_epoch(trainer: pl.Trainer, dataloader: Any) -> Any:
    """The training ``dataloader`` to use: for a run resumed mid-epoch with Lightning's distributed sampler, one
    that starts after the batches already trained (see the module docstring); ``dataloader`` itself otherwise."""
    if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
        return dataloader
    done = batches_already_trained(trainer)
    sampler, batch_sampler = dataloader.sampler, dataloader.batch_sampler
    if (
        done == 0
        or isinstance(dataloader, _Stateful)  # Lightning restores its position itself
        or isinstance(dataloader.dataset, IterableDataset)
        or type(sampler) is not DistributedSampler
        or type(batch_sampler) is not BatchSampler
    ):
        return dataloader
    if done >= _parse_num_batches(RunningStage.TRAINING, len(dataloader), trainer.limit_train_batches):
        return dataloader  # the epoch was complete: the next one starts from its beginning
    epoch = trainer.current_epoch  # mid-epoch the value the loop gives set_epoch for this epoch
    resuming = ResumingDistributedSampler(sampler, epoch, done * batch_sampler.batch_size)
    try:
        resumed = _update_dataloader(dataloader, resuming, mode=RunningStage.TRAINING)
    except Exception as error:  # noqa: BLE001 - a DataLoader subclass Lightning cannot rebuild: say so, go on
        rank_zero_warn(
            f"the training DataLoader ({type(dataloader).__name__}) cannot be rebuilt with a sampler that skips the "
            f"{done} batches this epoch already trained ({error}); the resumed epoch starts from its beginning"
        )
        return dataloader
    _silence_not_resumable()
    rank_zero_info(f"resuming mid-epoch: the sampler skips the {done} batches of epoch {epoch} already trained")
    return resumed


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
_silenced: list[Any] = []  # the warnings filter entry in place while the loop checks the resumed loader


def _silence_not_resumable() -> None:
    """Lightning's warning that the loader is not resumable does not apply to a resumed one: ignore it until the
    first training batch starts (the loop checks before it; :func:`stop_silencing`), and no longer."""
    stop_silencing()
    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE, category=PossibleUserWarning)
    _silenced.append(warnings.filters[0])


def stop_silencing() -> None:
    """End what :func:`_silence_not_resumable` began (the strategy calls it as each training batch starts)."""
    while _silenced:
        entry = _silenced.pop()
        if entry in warnings.filters:  # an "ignore" entry leaves no trace in the registries: removing it is enough
            cast(list, warnings.filters).remove(entry)
