"""Guard rail: the run owns every random generator a step can draw from. The stage seeds torch's from --seed;
seed() seeds numpy's and Python's `random` alike, so that a task drawing from them in the process that trains
(outside its data set, which common/options/loaders.py seeds per sample) starts the same in every run; checkpoints
save all of them: Generators, which the guard rails add to the states a checkpoint holds. What cannot be owned: a generator of the task's own
(numpy.random.default_rng(), a torch.Generator made in the data set) and anything outside the process (time,
os.urandom).
"""

import random

import torch
import torch.distributed as dist

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
        for each in [saved, *(saved.get("ranks") or [])]:  # and every rank's
            if "python" in each:
                set_generators(each, scratch)
            else:  # a checkpoint of an older version: torch's alone
                scratch[0].set_state(each["cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


class Generators:
    """Every generator a step may draw from, as one of the states a checkpoint holds ("rng"): a run
    resumed part-way draws the dropout masks and augmentations the uninterrupted run would have. Every rank's: the
    ranks start alike (--seed), but each draws as its own batches ask (dropout over texts of their own lengths), and
    each got rank 0's back, its weights another run's. At another world size, rank 0's for all (tests/FAILURES.md)."""

    def __init__(self):
        self.ranks = None  # every rank's, gathered for the checkpoint written next (gather())
        self.held, self.saving = None, None  # (epoch, generators) at its last training step; those saved next

    def own(self):
        return generators() | {"cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}

    def hold(self, epoch):
        """At `epoch`'s last training step: the generators its evaluation starts from, which a save in the evaluation
        keeps (the resumed run evaluates again, from there): a model that draws in eval mode (a VAE's sample) drew
        from them since."""
        self.held = (epoch, self.own())

    def gather(self, evaluating=None):
        """Every rank, before a checkpoint is written (saving.Saving.writing()): each rank's generators, on rank 0; in
        the evaluation of epoch `evaluating`, those held at its last step."""
        held = self.held if self.held and self.held[0] == evaluating else None
        self.saving = held and held[1]
        if dist.is_initialized():
            self.ranks = [None] * dist.get_world_size()
            dist.all_gather_object(self.ranks, self.saving or self.own())

    def state_dict(self):
        mine, ranks, self.ranks = (
            self.saving or self.own(),
            self.ranks,
            None,
        )  # rank 0's, which writes: one checkpoint's
        if ranks is not None and not torch.equal(ranks[0]["cpu"], mine["cpu"]):  # never: nothing draws in between
            raise RuntimeError("the generators were drawn from between their gathering and the checkpoint")
        return mine | ({"ranks": ranks} if ranks is not None else {})

    def load_state_dict(self, saved):
        ranks = saved.get("ranks") or []  # none: one process, or a checkpoint of an older version
        if dist.is_initialized() and len(ranks) == dist.get_world_size():
            saved = ranks[dist.get_rank()]
        if "python" in saved:  # a checkpoint of an older version holds torch's alone
            set_generators(saved)
        torch.set_rng_state(saved["cpu"])
        if saved["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
