"""Which samples each epoch trains on, in which order, drawn with which random numbers: so that a
run stopped part-way through an epoch (a Slurm requeue, a torchrun restart) and resumed trains on
the samples, augmented alike, that the uninterrupted run would have.

Resumable is the training sampler: each epoch's order follows from --seed and the epoch alone, and
an epoch can start at the sample where an earlier run stopped. Seeded draws each sample of a task's
own data set with the CPU generators seeded for that sample alone, from (--seed, epoch, index), and
each batch its collate() makes for its first sample: a random augmentation (or masking) draws the
same with 0 or 8 DataLoader workers, at any world size, resumed or not.
"""

import hashlib
import itertools
import math
import random

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler, get_worker_info

try:  # numpy comes with torch's stack; where it does not, no task can draw from it
    import numpy
except ImportError:
    numpy = None


class Resumable(Sampler):
    """`sampler` (a RandomSampler with its own generator, or a DistributedSampler), its epochs able
    to start part-way: resume_at(epoch, samples) skips that epoch's first `samples`, over all ranks.
    A DistributedSampler deals rank r every world_size-th sample of one order, so those seen are its
    first at any world size: resumed at another, the rest is dealt anew, none skipped or twice."""

    def __init__(self, sampler, seed):
        self.sampler, self.seed, self.epoch, self.skip = sampler, seed, 0, (0, 0)

    def set_epoch(self, epoch):
        self.epoch = epoch
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        else:
            self.sampler.generator.manual_seed(self.seed + epoch)

    def resume_at(self, epoch, samples):
        self.skip = (epoch, samples)

    def skipped(self):
        """The samples of this epoch that an earlier run trained on, over all ranks."""
        return self.skip[1] if self.skip[0] == self.epoch else 0

    def __len__(self):
        if isinstance(self.sampler, DistributedSampler):
            rest = len(self.sampler.dataset) - self.skipped()
            return max(0, math.ceil(rest / self.sampler.num_replicas))
        return max(0, len(self.sampler) - self.skipped())

    def __iter__(self):
        skip, sampler = self.skipped(), self.sampler
        if not skip:
            yield from sampler
        elif isinstance(sampler, DistributedSampler):  # the epoch's whole order, then deal the rest
            whole = DistributedSampler(sampler.dataset, 1, 0, sampler.shuffle, sampler.seed)
            whole.set_epoch(self.epoch)
            order = list(whole)
            rest = order[skip:]  # padded as DistributedSampler pads: with the order's first samples
            rest += itertools.islice(itertools.cycle(order), -len(rest) % sampler.num_replicas)
            yield from rest[sampler.rank :: sampler.num_replicas]
        else:
            yield from list(sampler)[skip:]


class Tagged(Sampler):
    """`sampler`'s indices as (index, epoch): what Seeded needs, in whichever process draws."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        return ((index, getattr(self.sampler, "epoch", 0)) for index in self.sampler)


class Seeded(Dataset):
    """A task's data set, read a batch at a time (Tagged's items, in a BatchSampler): each sample
    drawn with torch's CPU generator, numpy's and random's seeded from (seed, epoch, index), the
    batch's `collate` (padding, a random masking) from its first sample's: alike in a worker or not,
    resumed or not. The training process's are put back: its draws (dropout) do not follow these."""

    def __init__(self, dataset, seed, collate):
        self.dataset, self.seed, self.collate = dataset, seed, collate

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, batch):
        before = None if get_worker_info() else generators()  # a worker's are its own
        try:
            samples = []
            for index, epoch in batch:
                seed(self.seed, epoch, index)
                samples.append(self.dataset[index])
            index, epoch = batch[0]
            seed(self.seed, epoch, index, "batch")
            return self.collate(samples)
        except StopIteration as err:  # out of a DataLoader it would end the epoch's loop, unsaid
            raise RuntimeError(f"the task's data raised StopIteration near item {index}") from err
        finally:
            if before is not None:
                set_generators(before)


def seed(*key):
    """Seed torch's CPU generator, numpy's and random's from `key`: (--seed, epoch, index, ...)."""
    digest = hashlib.blake2b(" ".join(map(str, key)).encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    torch.default_generator.manual_seed(value)
    random.seed(value)
    if numpy is not None:  # 32-bit words: numpy takes no larger seed
        numpy.random.seed([value & 0xFFFFFFFF, value >> 32, 1])


def generators():
    """torch's CPU generator, numpy's and random's, as a checkpoint loads them (weights_only)."""
    found = {"cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": None}
    if numpy is not None:
        kind, words, position, has_gauss, gauss = numpy.random.get_state()
        found["numpy"] = (kind, torch.from_numpy(words.astype("int64")), position, has_gauss, gauss)
    return found


def set_generators(saved):
    torch.set_rng_state(saved["cpu"])
    version, words, gauss = saved["python"]
    random.setstate((version, tuple(words), gauss))
    if saved["numpy"] is not None and numpy is not None:
        kind, words, position, has_gauss, gauss = saved["numpy"]
        numpy.random.set_state((kind, words.numpy().astype("uint32"), position, has_gauss, gauss))
