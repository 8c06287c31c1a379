"""One rank produces a NaN loss at global step 2; every rank must stop with NonFiniteGradientError, unless the
module replaces non-finite gradients in ``on_after_backward`` (``--sanitize``), which trains as under DDP."""

import argparse

import lightning as L

import lightning_dp  # noqa: F401 - registers the strategies
from lightning_dp.comm.cluster.rendezvous import register_close_at_exit
from tests.scripts.models import RegressionModel

register_close_at_exit()  # Lightning's ddp leaves its gloo group up: pytorch/pytorch#190489

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", required=True)
parser.add_argument("--sanitize", action="store_true")
args = parser.parse_args()


class NaNOnRankOne(RegressionModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 2:
            loss = loss * float("nan")
        return loss

    def on_after_backward(self) -> None:
        if args.sanitize:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


L.Trainer(
    strategy=args.strategy, accelerator="cpu", devices=2, max_steps=5, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
).fit(NaNOnRankOne())  # fmt: skip
print("FINISHED")
