"""Data modules: handwritten digits that ship with scikit-learn (offline), MNIST, and random tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")


class _LoadersMixin:
    batch_size: int
    num_workers: int
    train_set: Dataset
    val_set: Dataset
    test_set: Dataset

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class DigitsDataModule(_LoadersMixin, LightningDataModule):
    """scikit-learn's 1,797 bundled 8x8 handwritten digits, upscaled to 1x28x28 and normalized; no download.

    A fixed-seed split holds out ``test_size`` images for testing and ``val_size`` for validation (both
    divisible by 2, 3 and 4 by default, so no rank sees padded duplicates). Normalization uses the training
    split's mean and standard deviation.
    """

    def __init__(
        self, batch_size: int = 64, test_size: int = 360, val_size: int = 180, seed: int = 0, num_workers: int = 0
    ) -> None:
        super().__init__()
        _check_batch_size(batch_size)
        if test_size < 1 or val_size < 1 or test_size + val_size >= 1797:
            raise ValueError(
                f"test_size and val_size must be positive and leave training data, got {test_size}, {val_size}"
            )
        self.batch_size, self.test_size, self.val_size = batch_size, test_size, val_size
        self.seed, self.num_workers = seed, num_workers

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        test, val, train = (
            order[: self.test_size],
            order[self.test_size : self.test_size + self.val_size],
            order[self.test_size + self.val_size :],
        )
        mean, std = images[train].mean(), images[train].std()
        images = (images - mean) / std
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])


class MNISTDataModule(_LoadersMixin, LightningDataModule):
    """torchvision's MNIST, normalized with mean 0.1307 and std 0.3081.

    ``download=True`` fetches it into ``data_dir`` when online; offline, ``data_dir`` must already hold
    ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``. The last ``val_size`` training images
    validate.
    """

    MEAN, STD = 0.1307, 0.3081

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 64,
        val_size: int = 5000,
        download: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_batch_size(batch_size)
        self.data_dir, self.batch_size, self.val_size = data_dir, batch_size, val_size
        self.download, self.num_workers = download, num_workers

    def _transform(self):
        from torchvision import transforms

        return transforms.Compose([transforms.ToTensor(), transforms.Normalize((self.MEAN,), (self.STD,))])

    def prepare_data(self) -> None:
        if self.download:
            from torchvision.datasets import MNIST

            MNIST(self.data_dir, train=True, download=True)
            MNIST(self.data_dir, train=False, download=True)

    def setup(self, stage: str | None = None) -> None:
        from torchvision.datasets import MNIST

        full = MNIST(self.data_dir, train=True, transform=self._transform())
        if not 0 < self.val_size < len(full):
            raise ValueError(f"val_size must be in (0, {len(full)}), got {self.val_size}")
        indices = list(range(len(full)))
        self.train_set = torch.utils.data.Subset(full, indices[: -self.val_size])
        self.val_set = torch.utils.data.Subset(full, indices[-self.val_size :])
        self.test_set = MNIST(self.data_dir, train=False, transform=self._transform())


class FakeDataModule(_LoadersMixin, LightningDataModule):
    """Random images and labels of a configurable shape, for benchmarks (the same tensors on every rank)."""

    def __init__(
        self,
        num_samples: int = 1024,
        image_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_batch_size(batch_size)
        self.num_samples, self.image_shape, self.num_classes = num_samples, tuple(image_shape), num_classes
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(self.seed)
        images = torch.randn(self.num_samples, *self.image_shape, generator=g)
        labels = torch.randint(0, self.num_classes, (self.num_samples,), generator=g)
        self.train_set = self.val_set = self.test_set = TensorDataset(images, labels)
