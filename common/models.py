"""The models (--model), built by `build` for a data set's channels, classes and image size; it
finds each by its name in MODELS, so a reader who follows it to one model reads that one alone. Each
returns log-probabilities: the stages' cross-entropy on them is F.nll_loss.

  net         pytorch/examples' mnist/main.py CNN, but for the channels and classes: 28x28 only
  cnn         a small VGG-style CNN that ends in global average pooling, so any image size fits
  wideresnet  WRN-depth-width of Zagoruyko & Komodakis, "Wide Residual Networks" (2016), for 32x32
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        # 64 channels x 12 x 12: what two 3x3 convolutions and a pooling leave of 28x28
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def conv_relu(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]


class CNN(nn.Module):
    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            *conv_relu(in_channels, 64),
            *conv_relu(64, 64),
            nn.MaxPool2d(2),
            *conv_relu(64, 128),
            *conv_relu(128, 128),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),  # one value per channel whatever the image size
        )
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return F.log_softmax(self.fc(self.dropout(self.features(x))), dim=1)


class Block(nn.Module):
    """A pre-activation basic block: (BN, ReLU, conv 3x3) twice, plus the input, through a 1x1
    convolution where the width or the resolution changes."""

    def __init__(self, cin, cout, stride, dropout):
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        projected = cin != cout or stride != 1
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if projected else None

    def forward(self, x):
        out = F.relu(self.bn1(x))
        # the projection takes the activated input, as in the authors' code: both paths normalized
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.dropout(F.relu(self.bn2(out))))
        return out + shortcut


class WideResNet(nn.Module):
    """WRN-depth-width: a 3x3 convolution, then three groups of (depth - 4) / 6 blocks, 16, 32 and
    64 times `width` channels wide, at 32x32, 16x16 and 8x8; BN, ReLU, global average pooling, one
    linear layer. WRN-16-4 has 2.75 M parameters."""

    def __init__(self, in_channels=3, num_classes=10, depth=16, width=4, dropout=0.0):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(
                f"--depth {depth}: a WideResNet is 6n+4 layers deep, n >= 1 (10, 16, 22, 28, 40)"
            )
        blocks = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        layers = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)]
        for group, stride in enumerate((1, 2, 2)):
            for i in range(blocks):
                cin = widths[group] if i == 0 else widths[group + 1]
                layers.append(Block(cin, widths[group + 1], stride if i == 0 else 1, dropout))
        layers += [nn.BatchNorm2d(widths[3]), nn.ReLU(inplace=True)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(widths[3], num_classes)
        for m in self.modules():
            self.init_weights(m)

    @staticmethod
    def init_weights(m):
        """The authors' initialization, layer by layer after PyTorch's: He et al. for convolutions,
        zero biases. Stage 05 applies it alike on the meta device (materialise())."""
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)

    def forward(self, x):
        return F.log_softmax(self.fc(self.features(x)), dim=1)


def blocks(model):
    """What stage 05 shards one at a time (and --checkpoint-activations recomputes): the layers with
    weights but norms of each nn.Sequential and nn.ModuleList; else each layer with weights."""
    found = []
    for seq in model.modules():  # outermost first; a list inside a block found is part of it
        listed = isinstance(seq, (nn.Sequential, nn.ModuleList))
        if listed and not any(seq in b.modules() for b in found):
            found += [m for m in seq.children() if list(m.parameters()) and m not in norms(seq)]
    return found or [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def gathered(blocks):
    """Stage 05's units: hooks cost per unit and step; the smallest blocks, together up to 1/8 of
    the largest, join the root."""
    sizes = sorted((sum(p.numel() for p in b.parameters()), i) for i, b in enumerate(blocks))
    running = itertools.accumulate(n for n, _ in sizes)  # each block's and all smaller ones'
    totals = dict(zip([i for _, i in sizes], running, strict=True))
    return [b for i, b in enumerate(blocks) if 8 * totals[i] > sizes[-1][0]]


def norms(model):
    """The BatchNorm layers: under --amp, stage 05 makes each a unit of its own, in fp32."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --model: what build() makes of each name; a size a model does not fit is refused in words (FITS)
MODELS = {"net": Net, "cnn": CNN, "wideresnet": WideResNet}
FITS = {
    "net": (28, "mnist, fashion-mnist", "cnn or wideresnet for 32x32"),
    "wideresnet": (32, "cifar10, cifar100, synthetic", "net or cnn for 28x28"),
}


def build(name, in_channels, num_classes, image_size, depth=16, width=4):
    """The model `name` of MODELS for images of in_channels x image_size x image_size in
    num_classes classes; a ValueError that says what to change for a size it does not fit."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: net, cnn or wideresnet")
    size, sets, instead = FITS.get(name, (image_size, "", ""))
    if image_size != size:
        raise ValueError(
            f"--model {name} fits {size}x{size} images ({sets}), not "
            f"{image_size}x{image_size}: use --model {instead}"
        )
    shape = dict(depth=depth, width=width) if name == "wideresnet" else {}
    return MODELS[name](in_channels, num_classes, **shape)
