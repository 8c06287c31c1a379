"""Train Lightning's own demo modules, unchanged, under a lightning-dp strategy, and run validate/test/predict.

Every rank checks after every batch that all replicas hold identical weights; rank 0 writes a summary.
"""

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, ManualOptimBoringModel, RandomDataset
from torch.utils.data import DataLoader

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="ring_allreduce")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--models", default="BoringModel,DemoModel,ManualOptimBoringModel")
parser.add_argument("--fit-only", action="store_true", help="skip validate/test/predict")
parser.add_argument("--start-method", default=None, help="strategy option start_method (a name has its default)")
parser.add_argument("--out", required=True)
args = parser.parse_args()


class CheckReplicasIdentical(L.Callback):
    def __init__(self):
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, *_):
        weights = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        gathered = pl_module.all_gather(weights)
        for rank in range(1, trainer.world_size):
            if not torch.equal(gathered[0], gathered[rank]):
                raise AssertionError(f"rank {rank} differs from rank 0 at step {trainer.global_step}")
        self.checked += 1


def strategy():
    if args.start_method is None:
        return args.strategy
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[args.strategy]
    return entry["strategy"](**{**entry["init_params"], "start_method": args.start_method})


def trainer(callback):
    return L.Trainer(
        strategy=strategy(),
        accelerator="cpu",
        devices=args.devices,
        max_steps=3,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def main():
    summary = {}
    classes = {c.__name__: c for c in (BoringModel, DemoModel, ManualOptimBoringModel)}
    for cls in (classes[name] for name in args.models.split(",")):
        torch.manual_seed(0)
        model = cls()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        check = CheckReplicasIdentical()
        t = trainer(check)
        loader = DataLoader(RandomDataset(32, 64), batch_size=2) if cls is DemoModel else None
        t.fit(model, train_dataloaders=loader)
        after = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        entry = {"steps": t.global_step, "moved": not torch.equal(before, after), "checked": check.checked,
                 "start_method": getattr(t.strategy.launcher, "_start_method", "popen")}  # fmt: skip
        if cls is BoringModel and not args.fit_only:
            entry["validate"] = t.validate(model)
            entry["test"] = t.test(model)
            predictions = t.predict(model)
            entry["predict_batches"] = len(predictions) if predictions is not None else None
        summary[cls.__name__] = entry
        if t.global_rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(summary, f)


if __name__ == "__main__":
    main()
