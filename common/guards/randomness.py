"""Guard rail: the run owns every random generator a step can draw from: torch's (CPU and CUDA), numpy's and
Python's `random`, in the process that trains and in each DataLoader worker.

In the process that trains, the stage seeds torch's from --seed and seed() numpy's and random's; a checkpoint
saves all of them (torch's in the lesson's run_state(), the others in the guard's state: states()) and a
resume restores them. A DataLoader worker's generators are in no checkpoint, and which worker draws which
sample depends on --num-workers and on where an epoch resumed; so every sample of a task's own data set is
drawn with all three CPU generators seeded for that sample alone, from (--seed, epoch, index) (Seeded): a
random augmentation draws the same for a sample with 0 or 8 workers, persistent or not, at any world size, in
a resumed epoch as in an uninterrupted one, and each sample (so each rank and each worker) draws its own
numbers. What cannot be owned: a generator of the task's own (numpy.random.default_rng(), a torch.Generator
made in the data set) and anything outside the process (time, os.urandom).
"""

import hashlib
import random

import torch
from torch.utils.data import Dataset, get_worker_info

try:  # numpy comes with torch's stack; where it does not, no task can draw from it
    import numpy
except ImportError:
    numpy = None


def seed(value):
    """numpy's and random's generators of this process from --seed (torch's: the stage's manual_seed)."""
    random.seed(value)
    if numpy is not None:
        numpy.random.seed(value)


def seed_cpu(value):
    """The generators a sample is drawn with, from a 64-bit `value`: torch's CPU one (not CUDA's, which the
    training draws from), numpy's and random's."""
    torch.default_generator.manual_seed(value)
    random.seed(value)
    if numpy is not None:
        # 32-bit words, a third one apart: random.seed(value) fills the same kind of generator from the first two
        numpy.random.seed([value & 0xFFFFFFFF, value >> 32, 1])


def states(with_torch=False):
    """numpy's and random's generators (and torch's CPU one), as plain values and tensors: a checkpoint loads
    them with weights_only."""
    found = {"python": random.getstate(), "numpy": None}
    if numpy is not None:
        kind, words, position, has_gauss, gauss = numpy.random.get_state()
        found["numpy"] = (kind, torch.from_numpy(words.astype("int64")), position, has_gauss, gauss)
    return found | ({"cpu": torch.get_rng_state()} if with_torch else {})


def restore(saved):
    """Set the generators to states()."""
    version, words, gauss = saved["python"]
    random.setstate((version, tuple(words), gauss))
    if saved["numpy"] is not None and numpy is not None:
        kind, words, position, has_gauss, gauss = saved["numpy"]
        numpy.random.set_state((kind, words.numpy().astype("uint32"), position, has_gauss, gauss))
    if "cpu" in saved:
        torch.set_rng_state(saved["cpu"])


def sample_seed(run_seed, epoch, index):
    """A 64-bit seed of its own for sample `index` in `epoch`."""
    digest = hashlib.blake2b(f"{run_seed} {epoch} {index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def drawn(dataset, index, value):
    """dataset[index], drawn with the CPU generators seeded from `value`. In a DataLoader worker they are the
    worker's own; in the process that trains they are put back as they were, so that the training's own draws
    (dropout, the next shuffle) do not depend on what the data set drew."""
    before = None if get_worker_info() else states(with_torch=True)
    seed_cpu(value)
    try:
        return dataset[index]
    finally:
        if before is not None:
            restore(before)


class Seeded(Dataset):
    """A task's own data set, each sample drawn with generators seeded for it alone (drawn()). An index is an
    (index, epoch) pair from the training sampler (resume.Sampler), or a plain index (evaluation: epoch 0)."""

    def __init__(self, dataset, run_seed):
        self.dataset, self.run_seed = dataset, run_seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        index, epoch = item if isinstance(item, tuple) else (item, 0)
        return drawn(self.dataset, index, sample_seed(self.run_seed, epoch, index))
