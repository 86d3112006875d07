"""Fixtures for every test: a tiny MNIST in the real on-disk format."""

import pytest
from helpers import REPO, TEST_SIZE, TRAIN_SIZE, write_idx_subset


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A --data-dir holding the first images of real MNIST as uncompressed IDX files, read by torchvision."""
    root = tmp_path_factory.mktemp("data")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", TRAIN_SIZE), ("t10k", TEST_SIZE)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{split}-{kind}-ubyte"
            write_idx_subset(REPO / "data" / "MNIST" / "raw" / f"{name}.gz", raw / name, count)
    return root
