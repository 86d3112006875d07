"""Every model with every data set it is offered for (cli.TESTED): one training step and one evaluation on
tiny copies of the sets in their real on-disk formats, read by the real readers; what `build`, `split`
and `dataset` refuse."""

import pickle
from types import SimpleNamespace
from urllib.error import URLError

import pytest
import torch
import torch.nn.functional as F

from common import cli, data, models

CPU = torch.device("cpu")
ARGS = SimpleNamespace(loader="batched", num_workers=0)
SHAPES = {  # in_channels, image_size, classes
    "mnist": (1, 28, 10),
    "fashion-mnist": (1, 28, 10),
    "cifar10": (3, 32, 10),
    "cifar100": (3, 32, 100),
    "synthetic": (3, 32, 10),
}
PAIRS = [(model, name) for model, names in cli.TESTED.items() for name in names]


def one_batch(dataset, size):
    return next(iter(data.loader(dataset, range(size), size, ARGS, CPU)))


@pytest.mark.parametrize("model_name, name", PAIRS)
def test_model_trains_and_evaluates_on_the_data_set(model_name, name, tiny_sets):
    train, test = data.dataset(tiny_sets, name, train=True), data.dataset(tiny_sets, name, train=False)
    channels, size, classes = SHAPES[name]
    assert (train.in_channels, train.image_size, train.classes) == (channels, size, classes)
    assert len(train.mean) == len(train.std) == train.in_channels
    torch.manual_seed(0)
    # WRN-10-1, the smallest: the depth and width change the size of the model, not what the test checks
    model = models.build(model_name, channels, classes, size, depth=10, width=1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    x, y = one_batch(train, 8)
    assert x.shape == (8, channels, size, size) and x.dtype == torch.float32
    model.train()
    loss = F.nll_loss(model(x), y)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    model.eval()
    x, y = one_batch(test, 4)
    with torch.no_grad():
        output = model(x)
    assert output.shape == (4, classes)
    torch.testing.assert_close(output.exp().sum(1), torch.ones(4))  # log-probabilities, for F.nll_loss
    assert torch.isfinite(F.nll_loss(output, y))


def test_wideresnet_16_4_is_the_papers():
    model = models.build("wideresnet", 3, 10, 32)  # the default depth and width
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 2.75


def test_net_keeps_the_names_checkpoints_hold():
    names = [f"{layer}.{kind}" for layer in ("conv1", "conv2", "fc1", "fc2") for kind in ("weight", "bias")]
    assert list(models.Net().state_dict()) == names


@pytest.mark.parametrize(
    "args, message",
    [
        (("net", 3, 10, 32), "--model net fits 28x28 images .* use --model cnn or wideresnet for 32x32"),
        (("wideresnet", 1, 10, 28), "--model wideresnet fits 32x32 images .* use --model net or cnn for 28x28"),
        (("wideresnet", 3, 10, 32, 15), "--depth 15: .* 6n\\+4"),
    ],
)
def test_build_refuses_what_does_not_fit(args, message):
    with pytest.raises(SystemExit, match=message):
        models.build(*args)


def test_split_is_seeded_disjoint_and_complete():
    count = 100
    images = torch.arange(count, dtype=torch.uint8).view(count, 1, 1, 1).expand(count, 1, 4, 4).contiguous()
    whole = data.Images("numbers", images, torch.arange(count), (0.5,), (0.25,), count)
    train, val = data.split(whole, 0.2, seed=1)
    assert (len(train), len(val)) == (80, 20) and type(train) is type(val) is data.Images
    assert sorted(torch.cat([train.labels, val.labels]).tolist()) == list(range(count))
    for part in train, val:
        assert torch.equal(part.images[:, 0, 0, 0].long(), part.labels)  # each image kept its label
        assert (part.mean, part.std, part.classes, part.image_size) == (whole.mean, whole.std, count, 4)
    assert torch.equal(data.split(whole, 0.2, seed=1)[1].labels, val.labels)
    assert not torch.equal(data.split(whole, 0.2, seed=2)[1].labels, val.labels)
    train, val = data.split(whole, 0, seed=1)
    assert train is whole and len(val) == 0 and val.images.shape[1:] == whole.images.shape[1:]


def test_a_missing_set_names_its_folder_and_make_data(tmp_path):
    with pytest.raises(SystemExit, match=f"{tmp_path / 'cifar-100-python'} .*`make data DATASET=cifar100`"):
        data.dataset(tmp_path, "cifar100", train=True)


def test_a_crafted_cifar_batch_runs_no_code(tiny_sets, tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").symlink_to(tiny_sets / "cifar-100-python" / "train")
    (folder / "test").write_bytes(pickle.dumps({b"data": Payload()}))
    assert len(data.dataset(tmp_path, "cifar100", train=True)) == 8
    with pytest.raises(SystemExit, match="not allowed"):
        data.dataset(tmp_path, "cifar100", train=False)
    assert not (tmp_path / "ran").exists()


def test_prepare_offline_says_where_to_run_it(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise URLError("no network")

    monkeypatch.setattr(f"torchvision.datasets.{data.SETS['cifar10'].download}", offline)
    with pytest.raises(SystemExit, match="cannot download cifar10 .*`make data DATASET=cifar10`"):
        data.prepare(tmp_path, "cifar10")
