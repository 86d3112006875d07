"""The order each epoch trains in: stage 01's sampler, reshuffled by set_epoch() as stages 03-05's
DistributedSampler is, each epoch's order from --seed and the epoch alone: a resumed run draws the
epochs it has left as the uninterrupted run would have."""

import torch
from torch.utils.data import RandomSampler


class Shuffled(RandomSampler):
    """A random order of `dataset`, the same for the same (seed, epoch)."""

    def __init__(self, dataset, seed):
        super().__init__(dataset, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.generator.manual_seed(self.seed + epoch)
