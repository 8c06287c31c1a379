"""The small CNN of the classic data-parallelism tutorial, as a LightningModule."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy


class ReferenceCNN(LightningModule):
    """conv 32 -> conv 64 -> max-pool -> fc 9216-128-20-10 -> log-softmax, for 1x28x28 images of 10 classes.

    Args:
        lr: learning rate of the optimizer.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (with momentum 0.9).
        weight_decay: L2 penalty of the optimizer.
        dropout: dropout after the convolutions and after the first fully connected layer (0 disables it).
    """

    def __init__(self, lr: float = 1e-3, optimizer: str = "adam", weight_decay: float = 0.0, dropout: float = 0.25):
        super().__init__()
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r} is not supported; allowed values: 'adam', 'adamw', 'sgd'")
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout = nn.Dropout(dropout)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 20)
        self.fc3 = nn.Linear(20, 10)
        self.val_accuracy = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout(F.max_pool2d(x, 2))
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        log_probs = self(x)
        self.log("val_loss", F.nll_loss(log_probs, y), sync_dist=True, prog_bar=True)
        self.val_accuracy(log_probs, y)
        self.log("val_acc", self.val_accuracy, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        log_probs = self(x)
        self.log("test_loss", F.nll_loss(log_probs, y), sync_dist=True)
        self.test_accuracy(log_probs, y)
        self.log("test_acc", self.test_accuracy)

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=1)

    def configure_optimizers(self):
        hp: Any = self.hparams  # an AttributeDict
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=0.9, weight_decay=hp.weight_decay)
        cls = torch.optim.AdamW if hp.optimizer == "adamw" else torch.optim.Adam
        return cls(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
