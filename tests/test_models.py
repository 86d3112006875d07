"""Every model with every data set it is offered for (the built-in task's TESTED): one training step and one evaluation on
tiny copies of the sets in their real on-disk formats, read by the real readers; what `build` refuses."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from common import data, models
from common.options import loaders
from common.tasks import images

CPU = torch.device("cpu")
ARGS = SimpleNamespace(loader="batched", num_workers=0, seed=1)
SHAPES = {  # in_channels, image_size, classes
    "mnist": (1, 28, 10),
    "fashion-mnist": (1, 28, 10),
    "cifar10": (3, 32, 10),
    "cifar100": (3, 32, 100),
    "synthetic": (3, 32, 10),
}
PAIRS = [(model, name) for model, names in images.TESTED.items() for name in names]


def one_batch(dataset, size):
    return next(iter(loaders.loader(dataset, range(size), size, CPU, ARGS)))


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
    with pytest.raises(ValueError, match=message):
        models.build(*args)


def test_the_built_in_task_offers_every_data_set():
    """The task names the data sets without importing torch (a job script's check reads its options)."""
    assert images.DATASETS == list(data.SETS)
