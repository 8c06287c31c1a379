"""One process replaying what ``tests/scripts/midepoch.py``'s ranks trained: the reference of its tests."""

from __future__ import annotations

import torch
from torch import nn


class Reference(nn.Module):
    """``tests/scripts/midepoch.py``'s model and data (``samples`` of them) in one process."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(samples, 6, generator=g)
        self.y = torch.randn(samples, 2, generator=g)

    def weights(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in self.parameters()])


def replay(
    batches: list[list[int]],
    history: list[tuple],
    samples: int,
    accumulate: int = 1,
    clip_norm: float | None = None,
    momenta: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One process training ``batches[j]`` (the samples of the job's ``j``-th global batch) with the script's
    optimizer, scheduler, accumulation and clipping by norm; ``history``: a rank's ``(epoch, batch index, ...)`` of
    each batch. The weights after every batch (and, into ``momenta``, the optimizer's momentum buffers, flat)."""
    model = Reference(samples)
    optimizer = torch.optim.SGD(model.net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    weights = []
    epoch_of = [entry[0] for entry in history]
    for j, epoch in enumerate(epoch_of):
        if j and epoch != epoch_of[j - 1]:
            scheduler.step()
        batch = sorted(batches[j])
        loss = nn.functional.mse_loss(model.net(model.x[batch]), model.y[batch]) / accumulate
        loss.backward()
        last_of_epoch = j + 1 == len(epoch_of) or epoch_of[j + 1] != epoch
        if (history[j][1] + 1) % accumulate == 0 or last_of_epoch:
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.net.parameters(), clip_norm)
            optimizer.step()
            optimizer.zero_grad()
        weights.append(model.weights())
        if momenta is not None:
            state = optimizer.state
            momenta.append(torch.cat([state[p]["momentum_buffer"].flatten() for p in model.net.parameters()]))
    return weights


def replay_loss(
    survivors: list[dict],
    seen: dict[int, list[int]],
    samples: int,
    clip_norm: float | None = None,
    momenta: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One process on the global batches a job that lost a rank trained: the survivors' samples of each batch and,
    for the steps committed with the lost rank, what it trained (``seen``: its own record by step); the weights
    after every batch."""
    with_lost = survivors[0]["rank_loss"]["loss_steps"][0]
    batches = [[i for s in survivors for i in s["trained"][j]] + (seen[j] if j < with_lost else [])
               for j in range(len(survivors[0]["trained"]))]  # fmt: skip
    return replay(batches, survivors[0]["history"], samples, clip_norm=clip_norm, momenta=momenta)


def read_seen(path) -> dict[int, list[int]]:
    """What a lost rank trained at each step until it died (``tests/scripts/midepoch.py``'s ``seen-rank<r>.txt``)."""
    seen = {}
    for line in path.read_text().splitlines():
        step, *indices = map(int, line.split())
        seen[step] = indices
    return seen
