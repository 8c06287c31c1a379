"""A reference model and data modules for the example app and the benchmarks (any LightningModule works too)."""

from lightning_dp.demos.cnn import ReferenceCNN
from lightning_dp.demos.data import DigitsDataModule, FakeDataModule, MNISTDataModule

__all__ = ["DigitsDataModule", "FakeDataModule", "MNISTDataModule", "ReferenceCNN"]
