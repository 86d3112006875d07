"""A segmentation UNet: each pixel of a 16 x 16 image is background or inside a square (class 1)
or a disc (class 2) drawn at random from --seed. Labels are (B, H, W) class numbers; the stages'
default loss (cross-entropy over the outputs' dim 1) takes them as they are. The metric is the
mean IoU over the classes on the whole test set: totals() counts a batch's intersections and
unions per class, figure() divides the epoch's (a mean of each image's IoU would be another
figure, undefined for an image without a disc).

    python 01_single_gpu/train.py --task common/tasks/examples/segmentation.py --epochs 2
    torchrun --standalone --nproc_per_node=2 05_fsdp/train.py \
        --task common/tasks/examples/segmentation.py --epochs 2
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

SIZE, CLASSES = 16, 3
metric = ("iou", "higher")


def add_arguments(group):
    group.add_argument("--samples", type=int, default=600, help="training images (default: 600)")


def shapes(n, seed):
    """n images (n, 1, SIZE, SIZE) and their masks (n, SIZE, SIZE): a square and a disc each."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    masks = torch.zeros(n, SIZE, SIZE, dtype=torch.long)
    for i in range(n):
        r, c, s = torch.randint(0, SIZE - 6, (3,), generator=g).tolist()
        masks[i, r : r + 3 + s % 4, c : c + 3 + s % 4] = 1
        r, c = torch.randint(3, SIZE - 3, (2,), generator=g).tolist()
        masks[i][(rows - r) ** 2 + (cols - c) ** 2 <= 5] = 2
    images = masks.float().unsqueeze(1) + 0.3 * torch.randn(n, 1, SIZE, SIZE, generator=g)
    return images, masks


def datasets(args):
    n = args.samples // 5
    train, test = shapes(args.samples, args.seed), shapes(n, args.seed + 1)
    limit = args.limit
    return TensorDataset(*(t[:limit] for t in train)), TensorDataset(*(t[:limit] for t in test))


def block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Two levels: down by pooling, up by a transposed convolution, joined with the skip."""

    def __init__(self, width=8):
        super().__init__()
        self.down = block(1, width)
        self.bottom = block(width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.out = nn.Sequential(block(2 * width, width), nn.Conv2d(width, CLASSES, 1))

    def forward(self, x):
        skip = self.down(x)
        x = self.up(self.bottom(nn.functional.max_pool2d(skip, 2)))
        return self.out(torch.cat([x, skip], dim=1))  # (B, CLASSES, H, W): a class per pixel


def model(args):
    return UNet()


def totals(output, target):
    """Per class, the pixels both predicted and labelled it, then those either."""
    predicted = nn.functional.one_hot(output.argmax(1), CLASSES).flatten(0, -2)
    labelled = nn.functional.one_hot(target, CLASSES).flatten(0, -2)
    both = (predicted & labelled).sum(0)
    return torch.cat([both, (predicted | labelled).sum(0)]).float()


def figure(totals):
    both, either = totals.view(2, CLASSES)
    return (both / either)[either > 0].mean()  # over the classes present
