"""Deterministic LightningModules for the equivalence tests, usable with or without a Trainer."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NUM_SAMPLES = 96
IN_FEATURES = 8


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=g)
    y = torch.randn(NUM_SAMPLES, 4, generator=g)
    return TensorDataset(x, y)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise ValueError(name)


class RegressionModel(LightningModule):
    """An MLP with a frozen layer and a branch only some samples use.

    ``branch`` runs only when the batch holds a sample with ``x[:, 0] > 1.5``, and then only those samples
    contribute through it, so the math is the same whether a batch is split over ranks or not, while on a
    given step some ranks (or all) produce no gradient for it.
    """

    def __init__(
        self, batch_size: int = 8, optimizer: str = "sgd", batchnorm: bool = False, explicit_sampler: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(IN_FEATURES, IN_FEATURES)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(
            nn.Linear(IN_FEATURES, 16), nn.BatchNorm1d(16) if batchnorm else nn.Identity(), nn.Tanh(), nn.Linear(16, 4)
        )
        self.branch = nn.Linear(IN_FEATURES, 4)
        self.batch_size = batch_size
        self.optimizer_name = optimizer
        self.explicit_sampler = explicit_sampler
        self.history: list[torch.Tensor] = []
        self.buffer_history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(self.frozen(x))
        mask = x[:, 0] > 1.5
        if mask.any():
            out = out + self.branch(x) * mask[:, None]
        return out

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        buffers = [b.detach().flatten().cpu().clone() for b in self.buffers()]
        if buffers:
            self.buffer_history.append(torch.cat(buffers))
        return self.loss(batch)

    def on_train_batch_end(self, *args) -> None:
        self.history.append(flat_weights(self))

    def train_dataloader(self):
        if self.explicit_sampler:  # one process, visiting the data in the order the distributed ranks share
            order = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(dataset(), batch_size=self.batch_size, sampler=order)
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())


class LayeredModel(RegressionModel):
    """Six linear layers (widths :data:`LAYERED_WIDTHS`), every parameter used on every step: no frozen layer, no
    branch. With a bucket cap of :data:`LAYERED_BUCKET_CAP_MB` the reducer cuts its gradients into five buckets of
    two or three parameters each and a partial last one of the first layer's weight, and every bucket but the last
    is complete while backward still runs."""

    def __init__(self, batch_size: int = 8, optimizer: str = "sgd", explicit_sampler: bool = False) -> None:
        super().__init__(batch_size, optimizer, explicit_sampler=explicit_sampler)
        torch.manual_seed(0)
        del self.frozen, self.branch
        layers: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(LAYERED_WIDTHS):
            layers += [nn.Linear(width_in, width_out), nn.Tanh()]
        self.body = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


LAYERED_WIDTHS = (IN_FEATURES, 10, 10, 10, 10, 10, 4)
#: 480 bytes: in backward's order, 16 + 160 + 40 | 400 + 40 | 400 + 40 | 400 + 40 | 400 + 40 | 320 bytes
LAYERED_BUCKET_CAP_MB = 480 / 2**20
MODELS = {"regression": RegressionModel, "layered": LayeredModel}


def flat_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu().clone() for p in module.parameters()])


def reference_training(
    global_batch: int,
    steps: int,
    optimizer: str,
    accumulate: int = 1,
    clip: str | None = None,
    clip_val: float = 0.05,
    model_name: str = "regression",
) -> list[torch.Tensor]:
    """Single-process training of ``MODELS[model_name]`` on the global batch: the weights after every optimizer
    step."""
    model = MODELS[model_name](global_batch, optimizer)
    opt = model.configure_optimizers()
    # Lightning gives each rank a DistributedSampler (shuffled, seed 0); its permutation for one replica is the
    # global order, and the ranks' step-k batches together are exactly the k-th global batch of that order.
    order = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=global_batch, sampler=order)

    def epochs():
        epoch = 0
        while True:
            order.set_epoch(epoch)  # reshuffled every epoch, like Lightning does
            yield from loader
            epoch += 1

    batches = epochs()
    history = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            (model.loss(next(batches)) / accumulate).backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip_val)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_([p for p in model.parameters() if p.grad is not None], clip_val)
        opt.step()
        history.append(flat_weights(model))
    return history


class TwoOptimizerModel(LightningModule):
    """GAN-style manual optimization: two optimizers, ``toggle_optimizer``, StepLR and ReduceLROnPlateau."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, IN_FEATURES))
        self.disc = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.batch_size = batch_size
        self.history: list[torch.Tensor] = []
        self.lrs: list[tuple[float, float]] = []

    def generator_loss(self, x):
        return F.softplus(-self.disc(self.gen(x))).mean()

    def discriminator_loss(self, x):
        return F.softplus(-self.disc(x)).mean() + F.softplus(self.disc(self.gen(x).detach())).mean()

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        self.toggle_optimizer(opt_g)
        opt_g.zero_grad()
        self.manual_backward(self.generator_loss(x))
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        opt_d.zero_grad()
        d_loss = self.discriminator_loss(x)
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log("d_loss", d_loss, sync_dist=True)
        sched_g.step()
        sched_d.step(self.trainer.strategy.reduce(d_loss.detach()))
        self.history.append(flat_weights(self))
        self.lrs.append((opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]))

    def configure_optimizers(self):
        opt_g, opt_d = make_two_optimizers(self)
        return [opt_g, opt_d], [
            torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.7),
            torch.optim.lr_scheduler.ReduceLROnPlateau(opt_d, factor=0.5, patience=0, threshold=0.5),
        ]

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


def make_two_optimizers(model):
    return (
        torch.optim.Adam(model.gen.parameters(), lr=0.01),
        torch.optim.SGD(model.disc.parameters(), lr=0.1, momentum=0.9),
    )


def reference_two_optimizers(global_batch: int, steps: int) -> tuple[list[torch.Tensor], list[tuple[float, float]]]:
    """Single-process version of ``TwoOptimizerModel``'s loop on the global batch."""
    model = TwoOptimizerModel(global_batch)
    (opt_g, opt_d), (sched_g, sched_d) = model.configure_optimizers()
    order = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    batches = iter(DataLoader(dataset(), batch_size=global_batch, sampler=order))
    history, lrs = [], []
    for _ in range(steps):
        x, _ = next(batches)
        model.disc.requires_grad_(False)
        opt_g.zero_grad()
        model.generator_loss(x).backward()
        opt_g.step()
        model.disc.requires_grad_(True)
        model.gen.requires_grad_(False)
        opt_d.zero_grad()
        d_loss = model.discriminator_loss(x)
        d_loss.backward()
        opt_d.step()
        model.gen.requires_grad_(True)
        sched_g.step()
        sched_d.step(d_loss.detach())
        history.append(flat_weights(model))
        lrs.append((opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]))
    return history, lrs
