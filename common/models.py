"""The models (--model), built by `build` for a data set's channels, classes and image size; it finds each
by its name in MODELS, so a reader who follows it to one model reads that one alone. Each returns
log-probabilities, as the stages train with F.nll_loss.

  net         the CNN of pytorch/examples mnist/main.py, unchanged but for the channels and classes: 28x28 only
  cnn         a small VGG-style CNN that ends in global average pooling, so any image size fits
  wideresnet  WRN-depth-width of Zagoruyko & Komodakis, "Wide Residual Networks" (2016), for 32x32 images
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
            *conv_relu(in_channels, 64), *conv_relu(64, 64), nn.MaxPool2d(2),
            *conv_relu(64, 128), *conv_relu(128, 128),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),  # one value per channel whatever the image size
        )  # fmt: skip
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
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if cin != cout or stride != 1 else None

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
            raise ValueError(f"--depth {depth}: a WideResNet is 6n+4 layers deep, n >= 1 (10, 16, 22, 28, 40)")
        blocks = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        layers = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)]
        for group, stride in enumerate((1, 2, 2)):
            for i in range(blocks):
                cin = widths[group] if i == 0 else widths[group + 1]
                layers.append(Block(cin, widths[group + 1], stride if i == 0 else 1, dropout))
        layers += [nn.BatchNorm2d(widths[3]), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(widths[3], num_classes)
        for m in self.modules():
            self.init_weights(m)

    @staticmethod
    def init_weights(m):
        """The authors' initialization, layer by layer after PyTorch's: He et al. for convolutions,
        zero biases. Stage 05 applies it the same way to a model built on the meta device
        (materialise())."""
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)

    def forward(self, x):
        return F.log_softmax(self.fc(self.features(x)), dim=1)


def blocks(model):
    """The pieces stage 05 shards one at a time and, with --checkpoint-activations, recomputes in the
    backward pass: the layers with weights that a model lists in order (the children of its nn.Sequential and
    nn.ModuleList: a WideResNet's residual blocks, a transformer's layers), but its norms; in a model that
    lists none, each layer with weights."""
    found = []
    for seq in model.modules():  # outermost first; a list inside a block found already is part of it
        if isinstance(seq, (nn.Sequential, nn.ModuleList)) and not any(seq in b.modules() for b in found):
            found += [m for m in seq.children() if list(m.parameters()) and m not in norms(seq)]
    return found or [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def gathered(blocks):
    """Stage 05's units: hooks cost per unit and step; the smallest blocks, together up to 1/8 of the largest, join the root."""
    sizes = sorted((sum(p.numel() for p in b.parameters()), i) for i, b in enumerate(blocks))
    totals = dict(zip((i for _, i in sizes), itertools.accumulate(n for n, _ in sizes), strict=True))  # smallest first
    return [b for i, b in enumerate(blocks) if 8 * totals[i] > sizes[-1][0]]


def norms(model):
    """The BatchNorm layers: under --amp, stage 05 makes each a unit of its own, which computes in fp32."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --model: what build() makes of each name; a size a model does not fit is refused in words (FITS)
MODELS = {"net": Net, "cnn": CNN, "wideresnet": WideResNet}
FITS = {"net": (28, "mnist, fashion-mnist", "cnn or wideresnet for 32x32"),
        "wideresnet": (32, "cifar10, cifar100, synthetic", "net or cnn for 28x28")}  # fmt: skip


def build(name, in_channels, num_classes, image_size, depth=16, width=4):
    """The model `name` of MODELS for images of in_channels x image_size x image_size in num_classes classes;
    a ValueError that says what to change for a size it does not fit."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: net, cnn or wideresnet")
    size, sets, instead = FITS.get(name, (image_size, "", ""))
    if image_size != size:
        raise ValueError(f"--model {name} fits {size}x{size} images ({sets}), not {image_size}x{image_size}: "
                         f"use --model {instead}")  # fmt: skip
    shape = dict(depth=depth, width=width) if name == "wideresnet" else {}
    return MODELS[name](in_channels, num_classes, **shape)


def materialise(model, device, task, args):
    """Stage 05 builds the model on the meta device (shapes, no memory) and shards it; each rank then allocates
    its own shards and fills them, never holding more than one layer whole: from the task's file of whole
    weights, `weights(args)`, if it names one, else with stage 01's initial weights at the same seed (each
    layer's reset_parameters(), children first as a constructor runs them, then the task's or the model's
    init_weights(layer)): the same at any world size. A task built on the CPU (META = False) is only moved."""
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return model.to(device)
    model.to_empty(device=device)
    if getattr(task, "weights", None) and (path := task.weights(args)):
        return load_whole(model, path)
    resets = [m for m in post_order(model, set()) if reset_of(m) and list(held(m, True))]
    covered = {id(t) for m in resets for *_, t in held(m, True)}
    for name, m in model.named_modules():
        if any(id(t) not in covered for *_, t in held(m)):
            raise TypeError(f"{name} ({type(m).__name__}) has tensors that no reset_parameters() sets, which "
                            "stage 05 needs to initialise a model built on the meta device: give it one, or set "
                            "META = False in the task file")  # fmt: skip
    done, init = set(), getattr(task, "init_weights", None) or getattr(model, "init_weights", None)
    for m in resets:
        on_cpu(m, reset_of(m), done, recurse=True)
    for m in model.modules() if init else ():
        on_cpu(m, lambda m=m: init(m), done)
    return model


def post_order(module, seen):
    for child in module.children():
        if child not in seen:
            yield from post_order(child, seen)
    seen.add(module)
    yield module


def reset_of(module):
    return getattr(module, "reset_parameters", None) or getattr(
        module, "_reset_parameters", None
    )  # the latter: attention's


def held(module, recurse=False):
    """(owner, "_parameters" or "_buffers", name, tensor) for each tensor of `module` (and its sub-layers)."""
    for owner in module.modules() if recurse else [module]:
        for kind in ("_parameters", "_buffers"):
            yield from ((owner, kind, name, t) for name, t in getattr(owner, kind).items() if t is not None)


def on_cpu(module, init, done, recurse=False):
    """init() on CPU copies of the whole tensors of `module` (their values so far if `done`, gathered), drawing
    from the global generator as the constructor did; then each rank keeps its own shard of each."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    slots = list(held(module, recurse))
    for owner, kind, name, t in slots:
        whole = (t.full_tensor() if isinstance(t, DTensor) else t) if id(t) in done else torch.empty(t.shape)
        whole = whole.detach().to("cpu", t.dtype, copy=True)
        getattr(owner, kind)[name] = nn.Parameter(whole, t.requires_grad) if kind == "_parameters" else whole
    try:
        with torch.no_grad():
            init()
            for owner, kind, name, t in slots:
                whole, local = getattr(owner, kind)[name], t
                if isinstance(t, DTensor):  # this rank's piece, cut as fully_shard cut it: no communication
                    whole = distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()
                    local = t.to_local()
                local.copy_(whole)
                done.add(id(t))
    finally:
        for owner, kind, name, t in slots:
            getattr(owner, kind)[name] = t


def load_whole(model, path):
    """A file of whole weights into the sharded model: rank 0 maps it from disk, the others receive their
    shards of each tensor; no GPU holds it whole."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    weights = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if rank0 else {}
    if dist.is_initialized():
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model.load_state_dict(weights)
    return model
