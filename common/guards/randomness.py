"""Guard rail: the run owns every random generator a step can draw from. The stage seeds torch's from --seed;
seed() seeds numpy's and Python's `random` alike, so that a task drawing from them in the process that trains
(outside its data set, which common/options/loaders.py seeds per sample) starts the same in every run; checkpoints
save all of them (common/checkpoint.py run_state()). What cannot be owned: a generator of the task's own
(numpy.random.default_rng(), a torch.Generator made in the data set) and anything outside the process (time,
os.urandom).
"""

import random

try:  # numpy comes with torch's stack; where it does not, no task can draw from it
    import numpy
except ImportError:
    numpy = None


def seed(value):
    """numpy's and random's generators of this process from --seed (torch's: the stage's manual_seed)."""
    random.seed(value)
    if numpy is not None:
        numpy.random.seed(value)
