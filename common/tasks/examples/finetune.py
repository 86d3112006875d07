"""Fine-tuning torchvision's resnet18 on an ImageFolder (a folder per class, under train/ and test/)
from a file of whole weights, say ImageNet's (torchvision's resnet18 state dict, saved with
torch.save): every stage starts from weights(args); the new head (fc.*, 1000 classes there, one per
folder here) is left at its initialisation (FRESH). Stage 05 maps the file on rank 0 alone.

    python 01_single_gpu/train.py --task common/tasks/examples/finetune.py \
        --folder photos/ --weights-file resnet18.pt --epochs 3 --lr 0.01 --optimizer sgd
"""

from pathlib import Path

import torchvision
from torch.utils.data import Subset
from torchvision.transforms import v2

FRESH = ("fc.",)  # the new head: one output per class folder, left as initialised
SIZE = 32  # every image resized to SIZE x SIZE


def add_arguments(group):
    group.add_argument("--folder", type=Path, required=True, help="train/ and test/ ImageFolders")
    group.add_argument("--weights-file", type=Path, help="resnet18 weights to start from")


def check(args):
    missing = [s for s in ("train", "test") if not (args.folder / s).is_dir()]
    return f"--folder {args.folder} has no {' or '.join(missing)}/ folder" if missing else None


def datasets(args):
    import torch

    pipeline = v2.Compose([v2.ToImage(), v2.Resize((SIZE, SIZE)), v2.ToDtype(torch.float32, True)])
    sets = [torchvision.datasets.ImageFolder(args.folder / s, pipeline) for s in ("train", "test")]
    return tuple(spread(s, args.limit) for s in sets)


def spread(dataset, limit):
    """--limit's `limit` samples, spread evenly over `dataset`: an ImageFolder lists its samples
    class by class, and its first N were the first class alone (a run on them scored 100 %)."""
    n = min(len(dataset), limit or len(dataset))
    return Subset(dataset, [i * len(dataset) // n for i in range(n)])


def model(args):
    classes = len(torchvision.datasets.folder.find_classes(args.folder / "train")[0])
    return torchvision.models.resnet18(num_classes=classes)  # weights: weights(args), every stage


def weights(args):
    return args.weights_file
