"""Data modules: digits (offline, bundled), MNIST read from MNIST-format files the test writes, fake data."""

import struct

import pytest
import torch

from lightning_dp.demos import DigitsDataModule, FakeDataModule, MNISTDataModule, ReferenceCNN
from tests.helpers.launch import QUICK, run_app


def write_mnist(root, n_train=40, n_test=12):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        images[:, 0, 0] = 255
        labels = torch.arange(n, dtype=torch.uint8) % 10
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + images.numpy().tobytes()
        )
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.numpy().tobytes())
    return root


@pytest.mark.unit
def test_mnist_module_reads_mnist_files_with_the_reference_normalization(tmp_path):
    dm = MNISTDataModule(data_dir=str(write_mnist(tmp_path)), batch_size=8, val_size=10)
    dm.prepare_data()  # download=False: nothing to fetch
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (30, 10, 12)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 28, 28) and y.dtype == torch.long
    assert torch.allclose(x[:, 0, 0, 0], torch.full((8,), (1 - 0.1307) / 0.3081))
    test_labels = [int(y) for _, y in dm.test_set]
    assert test_labels == [i % 10 for i in range(12)]
    with pytest.raises(ValueError, match="val_size must be in"):
        MNISTDataModule(data_dir=str(tmp_path), val_size=100).setup("fit")


@pytest.mark.multiprocess
def test_train_py_on_mnist_files(tmp_path):
    write_mnist(tmp_path / "data", n_train=64 * 2 + 16, n_test=16)
    run_app(["data=mnist", f"data.data_dir={tmp_path}/data", "data.val_size=16", "global_batch_size=16", *QUICK,
             f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)  # fmt: skip
    assert (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.unit
def test_digits_split_shapes_and_normalization():
    dm = DigitsDataModule(batch_size=32)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (1797 - 540, 180, 360)
    x, y = dm.train_set.tensors
    assert x.shape[1:] == (1, 28, 28) and abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 1e-4
    assert set(y.tolist()) == set(range(10))
    assert ReferenceCNN()(x[:4]).shape == (4, 10)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        DigitsDataModule(batch_size=0)


@pytest.mark.unit
def test_fake_data_is_deterministic():
    a, b = FakeDataModule(num_samples=16, image_shape=(3, 8, 8)), FakeDataModule(num_samples=16, image_shape=(3, 8, 8))
    a.setup(), b.setup()
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0]) and a.train_set.tensors[0].shape == (16, 3, 8, 8)
