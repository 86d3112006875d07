"""The input pipelines: the same batches whichever --loader and data set, and `make data`'s checks."""

import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO
from torch.utils.data.distributed import DistributedSampler

from common import data

CPU = torch.device("cpu")


def batches(dataset, sampler, loader, batch_size=8):
    args = SimpleNamespace(loader=loader, num_workers=0)
    return list(data.loader(dataset, sampler, batch_size, args, CPU))


@pytest.mark.parametrize("name, held_out", [("mnist", 0), ("cifar10", 0), ("cifar10", 0.25)])
@pytest.mark.parametrize("loader", ["classic", "device"])
def test_every_loader_gives_the_batches_of_the_default(loader, name, held_out, tiny_sets):
    """Same sampler, same batches: the pipelines differ in speed, not in what the model sees; grey or
    colour images, a whole set or the training part of a split."""
    train, _ = data.split(data.dataset(tiny_sets, name, train=True), held_out, seed=3)
    sampler = DistributedSampler(train, num_replicas=3, rank=1, seed=7)  # a shard, as a DDP rank draws it
    sampler.set_epoch(2)
    reference = batches(train, sampler, "batched")
    assert sum(len(y) for _, y in reference) == len(sampler) == -(-len(train) // 3)
    for (x, y), (ref_x, ref_y) in zip(batches(train, sampler, loader), reference, strict=True):
        assert torch.equal(y, ref_y)
        torch.testing.assert_close(x, ref_x, rtol=0, atol=1e-5)  # ToTensor()/Normalize() round differently


def test_prepare_checks_and_unpacks_the_vendored_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    data.prepare(tmp_path)
    assert len(data.dataset(tmp_path, "mnist", train=False)) == 10_000
    corrupt = raw / "t10k-labels-idx1-ubyte"
    corrupt.write_bytes(corrupt.read_bytes()[:-1] + b"\x00")
    with pytest.raises(SystemExit, match="sha256"):
        data.prepare(tmp_path)


@pytest.mark.parametrize("loader", ["batched", "classic", "device"])
def test_an_empty_validation_set_yields_nothing(loader, tiny_data):
    """Without --val-fraction the validation set is empty, and every pipeline must take that in stride."""
    empty = data.split(data.dataset(tiny_data, "mnist", train=True), 0, seed=1)[1]
    assert batches(empty, range(0), loader) == []
