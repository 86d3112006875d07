"""--loader classic|device, --num-workers, and a task's own data set (loader()): the pipelines
beside the lesson's batched one (common/data.py), which a default run uses.

  classic  pytorch/examples' pipeline: one PIL image per sample through ToTensor and Normalize,
           as torchvision's data sets make them, collated per batch; what `make profile` shows
  device   the whole (small) data set in GPU memory: batches are drawn there, nothing is copied
  a task's own data set (no common/data.py Images): read a batch at a time in DataLoader workers
           (--num-workers), each sample drawn with the generators seeded for it alone (Seeded)

Why they exist: the classic pipeline is the baseline the batched one is measured against
(BENCHMARKS.md: 6 s against 1.7 s an MNIST epoch on an H100), the device one the ceiling of
feeding (bench/gpu/measure.sh's p01dev); a task's own data set is any Dataset, and Seeded makes its
random augmentation (or a collate's masking) draw the same with 0 or 8 workers, at any world size,
resumed or not: a run stopped part-way and resumed trains on the samples, augmented alike, that
the uninterrupted run would have.
"""

import hashlib
import math
import os
import random

import torch
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, Dataset, default_collate, get_worker_info

from common.data import Images, normalize
from common.environment import cpus_per_rank
from common.guards.randomness import generators, numpy, set_generators  # numpy: None without it


def pipeline(args, task):
    """The loader of --loader and --num-workers for the task's data sets, called as the lesson's
    data.loader(dataset, sampler, batch_size, device); the task's collate() batches its samples."""
    collate = getattr(task, "collate", None)  # padding, masks; else stacking
    return lambda *sets: loader(*sets, args, collate)


def loader(dataset, sampler, batch_size, device, args, collate=None):
    """Batches of `dataset` in the order of `sampler`, by the pipeline --loader names; a data set
    read sample by sample is batched by `collate` (the task's: padding, masks), else stacked."""
    if args.loader == "device" and isinstance(dataset, Images):  # not the empty validation set
        return OnDevice(dataset, sampler, batch_size, device)
    per_sample = args.loader == "classic" or not isinstance(dataset, Images)  # one at a time
    workers = num_workers(args, per_sample)
    # pinned (page-locked) batches: the copy to the GPU can be asynchronous. Worker seeds from a
    # generator of their own, seeded by --seed: the global one, which checkpoints save, then
    # advances the same in a resumed run
    generator = torch.Generator().manual_seed(args.seed)
    pinned = device.type == "cuda"
    options = dict(num_workers=workers, pin_memory=pinned, persistent_workers=workers > 0)
    # workers forked, as on Linux before Python 3.14: a worker that 3.14's fork server starts
    # imports what it is handed by name, and the task's module (--task FILE's) has no such name
    if workers:
        options["multiprocessing_context"] = "fork"
    if isinstance(dataset, Images) and per_sample:  # classic
        dataset = PerSample(dataset)
        return DataLoader(
            dataset, batch_size, sampler=sampler, collate_fn=collate, generator=generator, **options
        )
    if not isinstance(dataset, Images):  # a task's own: samples and batches draw their own numbers
        dataset = Seeded(dataset, args.seed, collate or default_collate)
        sampler = Tagged(sampler)
    # the sampler's indices come in lists of batch_size, and the dataset builds each batch
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    return DataLoader(dataset, sampler=batches, batch_size=None, generator=generator, **options)


def num_workers(args, per_sample, env=os.environ):
    """--num-workers, else for a pipeline per sample (classic, or a task's data set) the rank's CPUs
    but one; none for the batched one: a batch is one indexing, cheaper than a worker's handing."""
    if args.loader == "device":
        return 0
    if args.num_workers is None and per_sample:
        return cpus_per_rank(env) - 1
    return args.num_workers or 0


class PerSample(Dataset):
    """What torchvision's data sets do per sample: a PIL image of the decoded array, ToTensor and
    Normalize. The DataLoader collates the samples into batches."""

    def __init__(self, dataset):
        from torchvision import transforms as T  # here: it doubles the time `import torch` takes

        self.images, self.labels = dataset.images, dataset.labels
        self.transform = T.Compose([T.ToTensor(), T.Normalize(dataset.mean, dataset.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].permute(1, 2, 0).squeeze(2).numpy()  # H x W x C, or H x W
        return self.transform(Image.fromarray(image)), int(self.labels[index])


class OnDevice:
    """The whole data set in device memory, batched in the sampler's order of each epoch."""

    def __init__(self, dataset, sampler, batch_size, device):
        # normalized on the CPU, as the batched loader does: the same floats on any device
        self.images = normalize(dataset.images, dataset.mean, dataset.std).to(device)
        self.labels = dataset.labels.to(device)
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        # one copy per epoch
        order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.images.device)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            yield self.images[batch], self.labels[batch]


class Tagged:
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
    batch's `collate` (padding; one that draws is refused: guards/samples.py) from its first
    sample's: alike in a worker or not, resumed or not. The training process's are put back: its
    draws (dropout) do not follow these."""

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
