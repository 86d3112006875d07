"""--optimizer, --momentum, --weight-decay, --scheduler, --step-size and --lr-scaling: another
optimizer or schedule than pytorch/examples' Adadelta and StepLR, which the lesson builds
(common/optim.py). hooks.recipe() builds these in the lesson's place where a run's values are not
the lesson's (flags.LESSON), whether a flag or the task set them.

--lr is the learning rate for a global batch of 64 (flags.REFERENCE_BATCH). When the global
batch grows, as it does with the number of GPUs at a fixed batch per GPU, --lr-scaling says how the
rate follows: `linear` (k times the batch, k times the rate: Goyal et al. 2017, for SGD, best with a
few epochs of warm-up), `sqrt` (the gradient noise shrinks with the square root of the batch: a
safer rule for adaptive optimizers such as Adam or Adadelta), or `none`.
"""

import torch

from common import optim
from common.options.flags import learning_rate

OPTIMIZERS = {
    "adadelta": torch.optim.Adadelta,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "rmsprop": torch.optim.RMSprop,
}


def optimizer(args, parameters):
    """--optimizer at --lr-scaling's rate, --weight-decay (and --momentum: sgd's, rmsprop's)."""
    momentum = {"momentum": args.momentum} if args.optimizer in ("rmsprop", "sgd") else {}
    rate = dict(lr=learning_rate(args), weight_decay=args.weight_decay, **momentum)
    return optim.optimizer(args, parameters, OPTIMIZERS[args.optimizer], **rate)


def scheduler(args, optimizer):
    """--scheduler: StepLR every --step-size epochs, or to 0 by cosine over --epochs; stepped once
    per epoch."""
    if args.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)


# the flags a task's own optimizer() or scheduler() replaces (hooks.recipe()), but those it reads
OPTIMIZER = ("optimizer", "lr", "lr_scaling", "momentum", "weight_decay")
SCHEDULER = ("scheduler", "gamma", "step_size")


def noting(args):
    """(`args`, noting each name a task's code reads of it, the names read): a --lr-scaling that a
    task's optimizer() never read was recorded as applied."""
    read = set()

    class Noted(type(args)):
        def __getattribute__(self, name):
            read.add(name)
            return super().__getattribute__(name)

    noted = Noted()
    noted.__dict__ = vars(args)  # the same values: what a task's code sets there, the run has too
    return noted, read
