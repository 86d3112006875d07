"""Guard rail: the run owns every random generator a step can draw from. The stage seeds torch's from --seed;
seed() seeds numpy's and Python's `random` alike, so that a task drawing from them in the process that trains
(outside its data set, which common/options/loaders.py seeds per sample) starts the same in every run; checkpoints
save all of them: Generators, which the guard rails add to the states a checkpoint holds. What cannot be owned: a generator of the task's own
(numpy.random.default_rng(), a torch.Generator made in the data set) and anything outside the process (time,
os.urandom).
"""

import random

import torch

try:  # numpy comes with torch's stack; where it does not, no task can draw from it
    import numpy
except ImportError:
    numpy = None


def seed(value):
    """numpy's and random's generators of this process from --seed (torch's: the stage's manual_seed)."""
    random.seed(value)
    if numpy is not None:
        numpy.random.seed(value)


def generators():
    """torch's CPU generator, numpy's and random's, as a checkpoint loads them (weights_only)."""
    found = {"cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": None}
    if numpy is not None:
        kind, words, position, has_gauss, gauss = numpy.random.get_state()
        found["numpy"] = (kind, torch.from_numpy(words.astype("int64")), position, has_gauss, gauss)
    return found


def set_generators(saved, into=None):
    """Put back what generators() returned: into this process's generators, or `into`'s (torch's, random's, numpy's)."""
    cpu, python, legacy = into or (torch.default_generator, random, numpy and numpy.random)
    cpu.set_state(saved["cpu"])
    version, words, gauss = saved["python"]
    python.setstate((version, tuple(words), gauss))
    if saved["numpy"] is not None and legacy is not None:
        kind, words, position, has_gauss, gauss = saved["numpy"]
        legacy.set_state((kind, words.numpy().astype("uint32"), position, has_gauss, gauss))


def unfit(saved):
    """Why a checkpoint's generators (Generators.state_dict()) cannot be put back, or None: tried on new generators of
    each kind first, so that a part missing or malformed is a line before anything of the checkpoint is restored."""
    scratch = (torch.Generator(), random.Random(), numpy and numpy.random.RandomState())
    try:
        if "python" in saved:
            set_generators(saved, scratch)
        else:  # a checkpoint of an older version: torch's alone
            scratch[0].set_state(saved["cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


class Generators:
    """Every generator a step may draw from, as one of the states a checkpoint holds ("rng"): a run
    resumed part-way draws the dropout masks and augmentations the uninterrupted run would have."""

    def state_dict(self):
        return generators() | {"cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}

    def load_state_dict(self, saved):
        if "python" in saved:  # a checkpoint of an older version holds torch's alone
            set_generators(saved)
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
