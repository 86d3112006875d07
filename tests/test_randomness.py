"""The run owns every random generator (common/options/loaders.py, common/guards/randomness.py): a random augmentation drawn from torch,
numpy or `random` in DataLoader workers resumes bit-identical, draws its own numbers per sample and per
--seed, the same with any number of workers; the fingerprint sees the data, not one draw; the repository's
own data set is chosen by its type, and the banner names the workers that run."""

import multiprocessing
import random
import signal
from types import SimpleNamespace

import numpy
import pytest
import torch
from helpers import REPO, S01, S03, assert_same_state, checkpoint, clean_env, python, stage_args, start
from test_preemption import SLOW, saved_mid_epoch, signal_mid_epoch_2, stopped_and_resumed
from torch.utils.data import Dataset

from common import cli, distributed, sampling
from common.guards import preflight, randomness, samples
from common.options import loaders

EXAMPLE = REPO / "common" / "tasks" / "augmented.py"
EVERY_GENERATOR = """from common.tasks.augmented import *
import random, numpy, torch
from common.tasks import augmented

class Noisy(augmented.Augmented):  # torchvision's crop and rotation draw from torch; noise from numpy and random
    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x * random.uniform(0.9, 1.1) + torch.from_numpy(numpy.random.normal(0, 0.1, x.shape)).float(), y

def datasets(args):
    train, test = augmented.datasets(args)
    return Noisy(train.images, train.transform), test
"""


def args(data_dir, out, *extra):
    return stage_args(data_dir, out, "--epochs", 2, "--batch-size", 32, *extra)


@pytest.mark.slow
def test_augmentation_from_torch_numpy_and_random_in_workers_resumes_bit_identical(tiny_data, tmp_path):
    task = tmp_path / "noisy.py"
    task.write_text(EVERY_GENERATOR)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    common = ("--task", task, "--num-workers", 2)  # the last --num-workers wins
    assert python(S01, *args(tiny_data, whole, *common)).returncode == 0
    proc = start(S01, *args(tiny_data, cut, *common), env=clean_env(**SLOW))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    saved_mid_epoch(cut, output, 128 + signal.SIGTERM, proc)
    resumed = python(S01, *args(tiny_data, cut, *common, "--resume"))
    assert resumed.returncode == 0 and "resumed at epoch 2" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_state(checkpoint(cut), checkpoint(whole))  # every tensor, the generators' states too


class Draws(Dataset):
    """Each sample: what torch, numpy and random draw for it. Its pixels in an attribute named `images`, as many
    data sets keep them: not the repository's Images for all that."""

    def __init__(self):
        self.images = torch.zeros(12, 1, 2, 2, dtype=torch.uint8)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        assert isinstance(index, int), f"handed {index!r}"
        return torch.tensor([torch.rand(1).item(), numpy.random.rand(), random.random()], dtype=torch.float64), 0


def draws(seed, workers, epoch=1, collate=None):
    options = SimpleNamespace(loader="batched", num_workers=workers, seed=seed)
    sampler = sampling.Shuffled(range(12), seed)
    sampler.set_epoch(epoch)
    loader = loaders.loader(Draws(), sampler, 4, torch.device("cpu"), options, collate)  # a task's own: seeded
    return torch.cat([x for x, _ in loader])


def test_each_sample_draws_its_own_numbers_from_the_seed_with_any_workers():
    before = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    one = draws(1, 0)
    after = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]
    assert one.unique().numel() == one.numel()  # no two samples, workers or generators draw alike
    assert torch.equal(draws(1, 2), one)  # 0 or 2 workers (each with a share of the batches): the same draws
    assert not torch.equal(draws(2, 2), one) and not torch.equal(draws(1, 2, epoch=2), one)  # per --seed, per epoch


OWN_DATA_SET = """
import torch
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor([float(index)]), index % 2
"""


def test_a_data_set_class_of_the_task_reaches_the_workers_whatever_python_starts_processes_with(tmp_path):
    """Python 3.14 starts processes from a fork server on Linux: a worker imports by name what it is handed, and the
    task's module, read from --task FILE, has no name it can import (every worker died: "No module named 'task_t'",
    a task's own data set trains with workers by default). Workers are forked, the task in them, whatever the
    default; the samples are those of forked workers."""
    path = tmp_path / "t.py"
    path.write_text(OWN_DATA_SET)
    task = cli.load_task(path)
    options = SimpleNamespace(loader="batched", num_workers=1, seed=1)
    default = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)  # 3.14's default on Linux
    try:
        loader = loaders.loader(task.Pairs(), range(8), 4, torch.device("cpu"), options)
        batches = [(x.flatten().tolist(), y.tolist()) for x, y in loader]
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert batches == [([0.0, 1.0, 2.0, 3.0], [0, 1, 0, 1]), ([4.0, 5.0, 6.0, 7.0], [0, 1, 0, 1])]


def masked(samples):
    """A task's collate() that draws: a random masking of each batch, as BERT's collator does."""
    x = torch.stack([x for x, _ in samples])
    return x * (torch.rand(x.shape, dtype=x.dtype) < 0.5), torch.tensor([y for _, y in samples])


def test_a_collate_that_draws_draws_the_same_with_any_workers_and_spends_none_of_the_runs_numbers():
    """The collate() ran unseeded: in a worker on what the batch's last sample left, without workers on the
    training process's generator (another masking with --num-workers 0 than 2; an evaluation stopped and run
    again after a resume drew more of it, and the run went on otherwise)."""
    before = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    one = draws(1, 0, collate=masked)
    after = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]
    assert torch.equal(draws(1, 2, collate=masked), one) and (one == 0).any() and (one != 0).any()
    assert not torch.equal(draws(1, 0, epoch=2, collate=masked), one)  # each epoch's batches mask anew


def test_a_collate_that_draws_is_refused_before_its_test_numbers_follow_the_batching():
    """A random masking in collate() draws per batch, from its first sample's seed: the same weights scored 73.4 %
    at the default --test-batch-size, 72.3 % at 7, and at two ranks another figure again. Refused in one line
    (mask in __getitem__, seeded per sample); a collate() that pads draws nothing and passes; the run's generators
    are left as they were."""
    pairs = [(torch.arange(4.0) + i, i % 2) for i in range(2)]
    task = SimpleNamespace(collate=masked)
    with pytest.raises(SystemExit, match=r"its collate\(\) draws random numbers .* --test-batch-size and the world"):
        samples.check_collate(SimpleNamespace(task="t.py"), task, "test", pairs)
    padded = SimpleNamespace(collate=lambda s: (torch.stack([x for x, _ in s]), torch.tensor([y for _, y in s])))
    before = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    samples.check_collate(SimpleNamespace(task="t.py"), padded, "test", pairs)  # seeded twice to compare
    after = torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate()
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]


def test_a_data_set_with_an_images_attribute_is_read_sample_by_sample():
    """The loader draws a task's own data set sample by sample, each seeded (loaders.Seeded): only Images, by
    type, are read in whole batches."""
    options = SimpleNamespace(loader="batched", num_workers=0, seed=1)
    batches = list(loaders.loader(Draws(), range(12), 4, torch.device("cpu"), options))
    assert [tuple(x.shape) for x, _ in batches] == [(4, 3)] * 3


def test_the_fingerprint_sees_the_data_not_a_draw_of_the_augmentation():
    state = torch.get_rng_state()
    assert preflight.fingerprint(Draws()) == preflight.fingerprint(Draws())  # numpy and random advanced between
    assert torch.equal(torch.get_rng_state(), state)  # and the run's own generators untouched


def test_numpy_and_random_are_saved_and_restored():
    randomness.seed(7)
    saved = randomness.Generators().state_dict()  # what the guard rails add to every checkpoint
    expected = numpy.random.rand(), random.random(), torch.rand(1)
    torch.save(saved, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    randomness.Generators().load_state_dict(torch.load(buffer, weights_only=True))  # as a checkpoint is read
    assert (numpy.random.rand(), random.random(), torch.rand(1)) == expected


def test_the_banner_names_the_workers_that_run(capsys):
    options = SimpleNamespace(loader="batched", num_workers=None, seed=1, output_dir="out")
    loader = loaders.loader(Draws(), range(12), 4, torch.device("cpu"), options)
    distributed.banner(options, 0, 0, 1, torch.device("cpu"), loader)
    assert f"loader batched, {loader.num_workers} workers" in capsys.readouterr().out
    assert loader.num_workers == loaders.num_workers(options, True)  # a data set of its own: the CPUs but one


@pytest.mark.slow
def test_the_augmented_example_stopped_mid_epoch_at_two_ranks_resumes_bit_identical(tiny_data, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    stopped_and_resumed(S03, tiny_data, whole, cut, "--task", EXAMPLE, "--num-workers", 1)
    assert_same_state(checkpoint(cut), checkpoint(whole))
