"""A training recipe of one's own on the sequences task (common/tasks/sequences.py): AdamW with two
parameter groups (no weight decay on biases and norms), a linear warm-up over the first --warmup
optimizer steps, stepped after each one, then a cosine decay to the end; run it with --clip-grad,
and AdamW's --lr (the stages' default, 1.0, is Adadelta's: refused).

    python 01_single_gpu/train.py --task common/tasks/examples/recipe.py --epochs 2 --clip-grad 1 \
        --lr 0.003
    torchrun --standalone --nproc_per_node=2 05_fsdp/train.py \
        --task common/tasks/examples/recipe.py --epochs 2 --clip-grad 1 --lr 0.003
"""

import math

import torch

from common.tasks import sequences

check, datasets, model = sequences.check, sequences.datasets, sequences.model


def add_arguments(group):
    sequences.add_arguments(group)
    group.add_argument("--warmup", type=int, default=20, help="warm-up steps (default: 20)")


def optimizer(args, net):
    """AdamW at --lr; biases and normalisation weights (one dimension) are not decayed."""
    decayed = [p for p in net.parameters() if p.ndim > 1]
    plain = [p for p in net.parameters() if p.ndim <= 1]
    groups = [{"params": decayed, "weight_decay": 0.05}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr)


def scheduler(args, optimizer):
    """Stepped after every optimizer step: warm-up, then cosine to 0 at the last step."""
    samples = min(args.samples, args.limit or args.samples)
    samples -= round(samples * (args.val_fraction or 0))  # held out: common/options/holdout.py
    steps = args.epochs * math.ceil(samples / args.batch_size)

    def factor(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = min(1, (step - args.warmup) / max(1, steps - args.warmup))
        return 0.5 * (1 + math.cos(math.pi * done))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
