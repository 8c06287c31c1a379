"""Lightning's features under one strategy, in as few launches as possible (the feature-matrix tests compare runs).

``--phase main``: one launch of two processes that runs
  1. fit with an uneven last batch (50 samples per rank, batches of 8), reshuffled every epoch,
     ``accumulate_grad_batches=2``, clipping by norm, AdamW + StepLR, ``sync_dist`` logging in training and
     validation, EarlyStopping on a metric only rank 1 sees stall, ModelCheckpoint, a frozen layer and a
     branch only some samples use; then validate / test / predict;
  2. fit in ``bf16-mixed`` with clipping by value, then with BatchNorm (rank 0's buffers broadcast each step);
  3. a GAN-style module: manual optimization, two optimizers, ``toggle_optimizer``, StepLR, ReduceLROnPlateau.
``--phase crash``: fit 1. with checkpoints, and rank 1 (``--kill-rank``) kills itself (SIGKILL) in the third epoch.
``--phase resume``: fit 1. again from ``ckpt_path="last"`` of the crashed run.

Each rank saves what it saw to ``<out>/rank<r>.pt``.
"""

import argparse
import os
import signal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from lightning_dp.comm.cluster.sockets import tcp_sockets
from tests.scripts import placement
from tests.scripts.models import IN_FEATURES, RegressionModel, TwoOptimizerModel, flat_weights

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--phase", choices=["main", "crash", "resume"], default="main")
parser.add_argument("--timeout", type=float, default=30.0)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--kill-rank", type=int, default=1, help="the rank the crash phase kills")
parser.add_argument("--staleness", default=None, help="strategy option: an integer, or 'none' (asynchronous)")
parser.add_argument("--num-servers", type=int, default=None, help="strategy option: dedicated server processes")
parser.add_argument("--out", required=True)
args = parser.parse_args()

DEVICES = args.devices
MAX_EPOCHS = 5


def indexed_dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN_FEATURES, generator=g), torch.randn(n, 4, generator=g), torch.arange(n))


class FeatureModel(RegressionModel):
    def __init__(self) -> None:
        super().__init__(batch_size=8, optimizer="adamw")
        self.seen: list[tuple[int, list[int]]] = []  # (epoch, sample indices) of every training batch
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append((self.current_epoch, index.tolist()))
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        # rank 0 keeps improving, rank 1 stalls after its second epoch: EarlyStopping must stop both together
        value = 1.0 / (self.current_epoch + 1) if self.global_rank == 0 else 1.0 / (min(self.current_epoch, 1) + 1)
        self.log("rank_metric", value, rank_zero_only=False)

    def test_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, _, index = batch
        return index, self(x)

    def on_train_batch_end(self, *args):
        super().on_train_batch_end(*args)
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def train_dataloader(self):
        return DataLoader(indexed_dataset(100, seed=1), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(indexed_dataset(30, seed=2), batch_size=8)

    test_dataloader = val_dataloader

    def predict_dataloader(self):
        return DataLoader(indexed_dataset(30, seed=2), batch_size=8)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        # an epoch-interval scheduler; ReduceLROnPlateau runs in the GAN-style module (Lightning does not replay
        # a plateau step taken after the last checkpoint when resuming, with any strategy, ddp included)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class Record(L.Callback):
    """Per step: the ``sync_dist`` logged loss; at set-up: this rank's TCP sockets."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.sockets: list[dict] = []

    def on_train_start(self, trainer, pl_module):
        self.sockets = tcp_sockets()

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.logged.append(float(trainer.callback_metrics["train_loss_step"]))


class RecordGradients(L.Callback):
    """Per optimizer step, the averaged gradients before clipping. Only where every rank holds them anyway (``ddp``,
    ``ring_allreduce``): a callback reading gradients makes the parameter servers send them back, another path than
    the one the feature matrix checks."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
        self.grads.append(torch.cat([g.detach().float().flatten().cpu() for g in grads]))


class KillRank(L.Callback):
    """SIGKILL rank ``rank`` at the end of batch ``batch`` of epoch ``epoch``: a machine dying mid-training."""

    def __init__(self, rank: int, epoch: int, batch: int) -> None:
        self.rank, self.epoch, self.batch = rank, epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def strategy(unused_parameters: bool = True):
    if args.strategy == "ddp":  # Lightning's reference; the module has parameters some steps do not use
        return placement.ddp(find_unused_parameters=unused_parameters)
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[args.strategy]
    options = placement.backend_options()
    if args.staleness is not None:
        options["staleness"] = None if args.staleness == "none" else int(args.staleness)
    if args.num_servers is not None:
        options["num_servers"] = args.num_servers
    return entry["strategy"](**entry["init_params"], timeout=placement.timeout(args.timeout), **options)


def trainer(callbacks, **kwargs) -> L.Trainer:
    options = dict(
        strategy=strategy(), **placement.trainer_placement(DEVICES), logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    options.update(kwargs)
    return L.Trainer(callbacks=callbacks, **options)


class EditOnFitStart(L.Callback):
    """Sets a weight in ``on_fit_start`` (after the strategy's set-up) and records it at ``on_train_start``, after
    the sanity check: the edit must survive (with staleness, the servers must take it)."""

    def on_fit_start(self, trainer, pl_module):
        with torch.no_grad():
            pl_module.branch.bias.fill_(0.123)

    def on_train_start(self, trainer, pl_module):
        self.seen = pl_module.branch.bias.detach().clone()


#: the strategies whose ranks hold the averaged gradients whatever the callbacks (see :class:`RecordGradients`)
GRADIENTS_HELD = ("ddp", "ring_allreduce")


def fit_features(checkpoint_dir: str, extra_callbacks=(), ckpt_path=None):
    model, record = FeatureModel(), Record()
    early_stopping = EarlyStopping(monitor="rank_metric", mode="min", patience=0)
    checkpoint = ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)
    sanity = {}
    if args.staleness is not None and args.phase == "main":  # the sanity check's flush must keep on_fit_start's edit
        extra_callbacks = (*extra_callbacks, EditOnFitStart())
        sanity = {"num_sanity_val_steps": 2}
    t = trainer(
        [record, early_stopping, checkpoint, *extra_callbacks],
        max_epochs=MAX_EPOCHS, accumulate_grad_batches=2, gradient_clip_val=0.1, gradient_clip_algorithm="norm",
        enable_checkpointing=True, **sanity,
    )  # fmt: skip
    t.fit(model, ckpt_path=ckpt_path)
    return t, model, record


def main():
    out = {}
    if args.phase == "crash":
        fit_features(
            os.path.join(args.out, "checkpoints"), extra_callbacks=[KillRank(rank=args.kill_rank, epoch=2, batch=2)]
        )
        raise AssertionError("rank 0 finished although rank 1 died")
    if args.phase == "resume":
        t, model, record = fit_features(os.path.join(args.out, "checkpoints"), ckpt_path="last")
        out.update(weights=model.history, final=flat_weights(model), epochs=t.current_epoch, lrs=model.lrs)
    else:
        gradients = RecordGradients()
        held = args.strategy in GRADIENTS_HELD and args.staleness is None
        t, model, record = fit_features(os.path.join(args.out, "checkpoints"), [gradients] if held else [])
        out.update(
            weights=model.history, final=flat_weights(model), seen=model.seen, lrs=model.lrs, logged=record.logged,
            grads=gradients.grads if held else None,
            sockets=record.sockets, epochs=t.current_epoch, stopped=t.should_stop, global_step=t.global_step,
            val_loss=float(t.callback_metrics["val_loss"]),
        )  # fmt: skip
        edits = [c for c in t.callbacks if isinstance(c, EditOnFitStart)]
        if edits:
            out["edited_at_train_start"] = edits[0].seen
        out["validate"] = t.validate(model, verbose=False)
        out["test"] = t.test(model, verbose=False)
        out["predict"] = t.predict(model)

        torch.manual_seed(0)
        bf16 = RegressionModel(batch_size=8, optimizer="sgd")
        trainer(
            [], precision="bf16-mixed", max_steps=3, gradient_clip_val=0.01, gradient_clip_algorithm="value",
            enable_checkpointing=False,
        ).fit(bf16)  # fmt: skip
        out["bf16_weights"] = bf16.history

        torch.manual_seed(0)
        batchnorm = RegressionModel(batch_size=8, optimizer="sgd", batchnorm=True)
        trainer([], max_steps=3, enable_checkpointing=False).fit(batchnorm)
        out["bn_weights"] = batchnorm.history
        out["bn_buffers"] = batchnorm.buffer_history  # as each step saw them (after broadcast, before forward)

        if args.strategy != "ddp":
            gan = TwoOptimizerModel()
            trainer([], max_steps=2 * 4, enable_checkpointing=False).fit(gan)
            out.update(gan_weights=gan.history, gan_lrs=gan.lrs)
    os.makedirs(args.out, exist_ok=True)
    torch.save(out, os.path.join(args.out, f"rank{t.global_rank}.pt"))


if __name__ == "__main__":
    main()
