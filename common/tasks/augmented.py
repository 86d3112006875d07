"""A task with random augmentation: MNIST through a torchvision transform pipeline (a random crop of
the padded image and a small random rotation), one sample at a time in DataLoader workers, as most
image tasks are trained. Copy this file to start your own (README, "Your own model and data"):

    python 01_single_gpu/train.py --task common/tasks/augmented.py --epochs 2 --num-workers 2
    torchrun --standalone --nproc_per_node=2 03_ddp_single_node/train.py \
        --task common/tasks/augmented.py

What to expect: with --limit 2000, one epoch of stage 01 on a CPU reaches about 68 % test accuracy.
The augmentation draws from torch's generator (numpy's or `random` would do as well); the stages
seed it for each sample from --seed, the epoch and the sample (common/options/loaders.py), so a
run stopped by SIGTERM and resumed with --resume ends with the same weights, to the last bit, as one
never stopped, with any --num-workers. The test set is not augmented."""

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from common import data, models

PADDING, DEGREES = 2, 10  # a crop of up to 2 pixels off centre, a rotation of up to 10 degrees


class Augmented(Dataset):
    """The images of common/data.py's Images, each one a tensor through `transform` as it is
    read."""

    def __init__(self, images, transform):
        self.images, self.transform = images, transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        image = self.images.images[index]  # uint8 C x H x W
        return self.transform(image), int(self.images.labels[index])


def pipeline(spec, train):
    """uint8 image -> normalized float image, with random crops and rotations for training."""
    randomly = (
        [v2.RandomCrop(spec.size, padding=PADDING), v2.RandomRotation(DEGREES)] if train else []
    )
    return v2.Compose(
        [*randomly, v2.ToDtype(torch.float32, scale=True), v2.Normalize(spec.mean, spec.std)]
    )


def model(args):
    spec = data.SETS["mnist"]
    return models.build("net", len(spec.mean), spec.classes, spec.size)


def datasets(args):
    """(training set, test set) of MNIST from --data-dir (`make data`), --limit images of each."""
    spec = data.SETS["mnist"]
    return tuple(
        Augmented(
            data.dataset(args.data_dir, "mnist", train=train, limit=args.limit),
            pipeline(spec, train),
        )
        for train in (True, False)
    )
