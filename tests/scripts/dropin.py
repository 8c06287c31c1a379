"""Ordinary LightningModule idioms under one strategy, in one launch of two processes (``tests/test_drop_in.py``
compares each run with Lightning's ``ddp`` running this same script).

Cases (``--cases``, default all):
  hooks       gradient edits in ``on_after_backward`` (a masked layer, a scaled layer), clipping one layer in
              ``on_before_optimizer_step``, a callback that edits a gradient, ``grad_norm`` logged there; and
              ``plain``, the same model without them, timed by a callback declaring ``reads_gradients = False``
  add_group   ``optimizer.add_param_group`` at step 2 with a parameter trainable from the start
  compiled    ``trainer.fit(torch.compile(model))`` and a module with a compiled submodule
  reentrant   reentrant activation checkpointing reusing one weight in two segments
  fp16        ``precision="16-true"`` with gradients whose sum over the ranks overflows float16
  bf16        ``precision="bf16-true"``: the buckets are bf16
  syncbn      ``sync_batchnorm=True`` (GPU runs only: SyncBatchNorm needs CUDA); its collectives run in backward
              on the default group while the gradients travel on the strategy's own
  resume      ``ddp`` trains 6 steps uninterrupted and saves a checkpoint after step 3 (``--save-checkpoint``),
              mid-epoch; every strategy resumes from it (``--resume-from``) and trains steps 4 to 6, which must
              equal ``ddp``'s (``ddp`` itself would replay the epoch's first batches: its resume is not exact)

Each rank saves one record per case (see :class:`Record`).
"""

import argparse
import os
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from tests.scripts import placement

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

CASES = ("hooks", "add_group", "compiled", "reentrant", "fp16", "bf16", "syncbn", "resume")
parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
parser.add_argument("--save-checkpoint", default=None, help="ddp: where the resume case saves its step-3 checkpoint")
parser.add_argument("--resume-from", default=None, help="the checkpoint the resume case starts from")
parser.add_argument("--num-servers", type=int, default=None, help="strategy option: dedicated server processes")
parser.add_argument("--out", required=True)
args = parser.parse_args()

STEPS = 5
FEATURES = 8


def data(n: int = 64, scale: float = 1.0) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(n, FEATURES, generator=g), torch.randn(n, 4, generator=g) * scale
    return DataLoader(TensorDataset(x, y), batch_size=8)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu().clone() for p in module.parameters()])


class Base(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(FEATURES, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.history: list[torch.Tensor] = []

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def on_train_batch_end(self, *args) -> None:
        self.history.append(flat(self))

    def train_dataloader(self):
        return data()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class GradientEdits(Base):
    """Masks ``a`` and scales ``c`` after backward, clips ``b`` before the step, logs ``grad_norm``."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def on_after_backward(self) -> None:
        for p in self.a.parameters():
            p.grad.zero_()
        for p in self.c.parameters():
            p.grad.mul_(0.5)

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = grad_norm(self, norm_type=2)
        self.norms.append(float(norms["grad_2.0_norm_total"]))
        self.log_dict(norms)
        torch.nn.utils.clip_grad_norm_(self.b.parameters(), 1e-3)


class DoubleBiasGradient(L.Callback):
    """A callback's edit: the last layer's bias gradient doubled before the step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.c.bias.grad.mul_(2.0)


class AddGroupLater(Base):
    """``c`` trains only from step 2, added with its own learning rate."""

    def configure_optimizers(self):
        return torch.optim.Adam([*self.a.parameters(), *self.b.parameters()], lr=0.01)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == 2:
            self.optimizers().optimizer.add_param_group({"params": list(self.c.parameters()), "lr": 0.05})


class CompiledSubmodule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.b = torch.compile(self.b)


class ReentrantCheckpointing(Base):
    """``b`` runs in two reentrant checkpoint segments, so its gradient is accumulated twice per backward."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        return self.c(h)


class LargeGradients(Base):
    """In float16 the gradient of ``c.bias`` is exactly 8 x 5000 = 40000 on every rank (the loss sums the outputs of
    a batch of 8, times 5000): their sum over two ranks (80000) overflows float16 (max 65504), their average does
    not. ``bias_grads`` records the averaged value every step."""

    def __init__(self) -> None:
        super().__init__()
        self.bias_grads: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x).float() * 5000.0).sum() + 0.0 * y.sum()  # summed in float32: the loss itself stays finite

    def on_before_optimizer_step(self, optimizer) -> None:
        self.bias_grads.append(float(self.c.bias.grad.float().abs().max()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-5)


def strategy(name: str, reentrant: bool = False):
    if name == "ddp":
        # DDP marks each parameter ready once per backward unless told the graph is static
        return placement.ddp(static_graph=True) if reentrant else placement.ddp()
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    options = {"num_servers": args.num_servers} if args.num_servers is not None else {}
    return entry["strategy"](**entry["init_params"], **options, timeout=placement.timeout(60),
                             **placement.backend_options())  # fmt: skip


class Record(L.Callback):
    """Saves, on each rank when training ends, ``<out>/<case>/rank<r>.pt``: the weights after every step, the
    ``grad_norm`` values the module saw, the strategy's traffic of the last step and its bucket dtypes. Runs in
    the rank's own process, so it works with every start method (spawn included)."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.bucket_dtypes: list[str] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        reducer = getattr(trainer.strategy, "reducer", None)
        if reducer is not None:
            self.bucket_dtypes = [str(b.buffer.dtype) for b in reducer.buckets]

    def on_train_end(self, trainer, pl_module) -> None:
        strategy_ = trainer.strategy
        stats = getattr(strategy_, "sync_stats", None)
        record = {
            "weights": pl_module.history, "norms": getattr(pl_module, "norms", None),
            "bias_grads": getattr(pl_module, "bias_grads", None),
            "bytes": stats.last_step_bytes if stats else None, "sync_bytes": stats.bucket_bytes if stats else None,
            "full_gradients": getattr(strategy_, "full_gradients", None), "bucket_dtypes": self.bucket_dtypes,
        }  # fmt: skip
        os.makedirs(os.path.join(args.out, self.case), exist_ok=True)
        torch.save(record, os.path.join(args.out, self.case, f"rank{trainer.global_rank}.pt"))


class SaveAfterStep(L.Callback):
    """Saves a checkpoint after step ``step`` (as ``ModelCheckpoint`` would) and keeps only the later steps' weights
    in the module's history (what a run resumed from it records)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_train_end(self, trainer, pl_module) -> None:
        del pl_module.history[: self.step]


class BackwardTimer(L.Callback):
    """Overrides the gradient hooks only to time backward, and says so: the parameter servers keep their plain step."""

    reads_gradients = False

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.start, self.seconds = time.perf_counter(), None

    def on_after_backward(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.start

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        assert self.seconds is not None, "on_after_backward did not run before this step"


def fit(case, model, callbacks=(), reentrant=False, fit_model=None, ckpt_path=None, **kwargs) -> L.Trainer:
    options = dict(
        strategy=strategy(args.strategy, reentrant), **placement.trainer_placement(2), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_steps=STEPS,
    )  # fmt: skip
    options.update(kwargs)
    callbacks = [*callbacks, Record(case)] if case else list(callbacks)
    trainer = L.Trainer(callbacks=callbacks, **options)
    trainer.fit(fit_model if fit_model is not None else model, ckpt_path=ckpt_path)
    return trainer


class WithBatchNorm(Base):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.norm(torch.tanh(self.a(x))))))


class AdamW(Base):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


def main() -> None:
    if "hooks" in args.cases:
        fit("hooks", GradientEdits(), callbacks=[DoubleBiasGradient()])
        fit("plain", Base(), callbacks=[BackwardTimer()])
    if "add_group" in args.cases:
        fit("add_group", AddGroupLater())
    if "compiled" in args.cases:
        model = Base()
        fit("compiled", model, fit_model=torch.compile(model))
        fit("compiled_submodule", CompiledSubmodule())
    if "reentrant" in args.cases:
        fit("reentrant", ReentrantCheckpointing(), reentrant=True)
    if "fp16" in args.cases:
        fit("fp16", LargeGradients(), precision="16-true")
    if "bf16" in args.cases:
        fit("bf16", Base(), precision="bf16-true")
    if "syncbn" in args.cases and placement.ACCELERATOR == "gpu":
        fit("syncbn", WithBatchNorm(), sync_batchnorm=True)
    if "resume" in args.cases:
        if args.save_checkpoint:  # ddp: six steps, the checkpoint everyone resumes from after the third
            model = AdamW()
            fit("resume", model, callbacks=[SaveAfterStep(3, args.save_checkpoint)], max_steps=6)
        else:  # and the state it ends with, as a checkpoint holds it (the optimizer's state where it was gathered)
            trainer = fit("resume", AdamW(), max_steps=6, ckpt_path=args.resume_from)
            trainer.save_checkpoint(os.path.join(args.out, "resume", "final.ckpt"))


if __name__ == "__main__":
    main()
