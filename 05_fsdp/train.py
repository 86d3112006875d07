"""Stage 05: the model sharded across the ranks with FSDP2, for models that do not fit one GPU.

Teaches: DDP keeps a whole copy of the weights, their gradients and the optimizer state on every GPU.
FSDP (fully_shard) keeps 1/world size of each on each rank and gathers one block's weights just before
that block runs, then frees them: memory per GPU falls with the number of GPUs, for about 1.5x DDP's
traffic. Checkpoints are sharded too: each rank writes its own piece, and a run resumes on any number
of GPUs (a requeued job that lands on fewer nodes continues). --save-model still writes the whole
weights, which stage 01's model loads.

Launch (from 05_fsdp/):
    sbatch job.slurm --epochs 3              # as stage 04: srun starts one task per GPU on every node
    sbatch job.slurm --model wideresnet --dataset cifar100 --amp --checkpoint-activations --grad-accum 2

Changes from stage 04: fully_shard per block and at the root instead of DDP; mixed precision through
FSDP's policy instead of autocast; micro-batches (--grad-accum) and recomputed activations
(--checkpoint-activations); sharded checkpoints; the memory line.

Expect: stage 04's accuracy at the same global batch; a memory line that shrinks with the world size.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/ sits beside the stage folders
try:
    from common import versions
except ModuleNotFoundError as err:
    if err.name != "common":
        raise
    raise SystemExit(
        f"error: no common/ beside {Path(__file__).resolve().parent}: copy the repository's common/ there, or install "
        "the repository: `make install` in it (its .venv), or `pip install --no-deps -e <repository>` (conda, modules)"
    ) from err
else:
    versions.require(__file__)  # first, before torch: an older one fails in the imports below, or mid-run

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint as recompute
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

from common import amp, checkpoint, cli, data, distributed, metrics, models, optim

try:
    from line_profiler import profile  # a no-op unless kernprof -l (or LINE_PROFILE=1) drives the run
except ImportError:

    def profile(func):
        return func


@profile
def train(model, device, loader, optimizer, scaler, epoch, args):
    model.train()
    totals = torch.zeros(2, device=device)  # summed on the device: no GPU -> CPU sync per step
    for batch_idx, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss, micro = 0, list(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum), strict=True))
        for i, (xm, ym) in enumerate(micro):  # --grad-accum: the rank's batch in slices, gradients summed
            if dist.is_initialized():  # reduce the gradients once, after the last slice, not after each
                model.set_requires_gradient_sync(i == len(micro) - 1)
            part = F.nll_loss(model(xm), ym, reduction="sum") / len(y)  # its share of the batch's mean loss
            scaler.scale(part).backward()
            loss += part.detach()
        scaler.step(optimizer)
        scaler.update()
        totals[0] += loss.detach() * len(y)
        totals[1] += len(y)
        if batch_idx % args.log_interval == 0:  # a progress line, and a diverged run stops here
            metrics.progress(epoch, batch_idx, len(loader), loss, totals, args)
        if args.dry_run:
            break
    return totals


@torch.no_grad()
def evaluate(model, device, loader):
    model.eval()
    totals = torch.zeros(3, device=device)  # summed loss, correct, samples
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        output = model(x)
        totals[0] += F.nll_loss(output, y, reduction="sum")
        totals[1] += (output.argmax(dim=1) == y).sum()
        totals[2] += len(y)
    return totals


def main():
    args = cli.parse_args(teaches=("grad_accum", "checkpoint_activations"))
    checkpoint.claim(args.output_dir)  # first: one run per folder, and a folder it can write
    rank, local_rank, world_size, device = distributed.setup(args)
    distributed.banner(args, rank, local_rank, world_size, device)
    torch.manual_seed(args.seed)

    train_set = data.dataset(args.data_dir, args.dataset, train=True, limit=args.limit)
    train_set, val_set = data.split(train_set, args.val_fraction, args.seed)  # val_set is empty without --val-fraction
    test_set = data.dataset(args.data_dir, args.dataset, train=False, limit=args.limit)
    distributed.agree(args, train_set, test_set)  # all ranks: the same options and the same data
    # each rank draws its own 1/world_size of every epoch, in an order all ranks agree on
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    batch_size = args.batch_size // world_size  # --batch-size is the global batch
    train_loader = data.loader(train_set, train_sampler, batch_size, args, device)
    # evaluation: an unpadded shard per rank (DistributedSampler would repeat samples to even out)
    val_loader = data.loader(val_set, range(rank, len(val_set), world_size), args.test_batch_size, args, device)
    test_loader = data.loader(test_set, range(rank, len(test_set), world_size), args.test_batch_size, args, device)

    shape = train_set.in_channels, train_set.classes, train_set.image_size
    model = models.build(args.model, *shape, args.depth, args.width).to(device)
    metrics.memory(model, args, world_size)
    if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    policy = amp.policy(model, device, args)  # --amp: bf16 compute, fp32 shards (FSDP's, not autocast)
    for block in models.blocks(model):
        if args.checkpoint_activations:  # keep the block's input only; rerun its forward in backward()
            recompute(block)
        if dist.is_initialized():  # each block's weights are gathered just before it runs, then freed
            fully_shard(block, mp_policy=policy)
    if dist.is_initialized():  # a plain `python train.py` has no process group and shards nothing
        # the rest (first and last layers) at the root; gradients are reduce-scattered during backward()
        fully_shard(model, mp_policy=policy)
    optimizer = optim.optimizer(args, model.parameters())
    scheduler = optim.scheduler(args, optimizer)
    scaler = amp.scaler(device, args)

    log = metrics.Log(args.output_dir, world_size)
    start_epoch = checkpoint.resume_sharded(args, model, optimizer, scheduler, scaler, log)
    for epoch in range(start_epoch, args.epochs + 1):
        if log.reached(args.target_accuracy, args.patience):  # the same all-reduced rows on every rank
            break
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first
        start = time.perf_counter()
        train_totals = train(model, device, train_loader, optimizer, scaler, epoch, args)
        seconds = metrics.elapsed(start, device)
        totals = torch.cat([train_totals, evaluate(model, device, val_loader), evaluate(model, device, test_loader)])
        if dist.is_initialized():
            dist.all_reduce(totals)  # sums over the ranks: losses, samples, correct answers
        log.epoch(epoch, scheduler.get_last_lr()[0], seconds, totals.tolist())
        scheduler.step()
        checkpoint.save_sharded(args, epoch, model, optimizer, scheduler, scaler, log)
    log.summary()
    if args.save_model:
        checkpoint.save_model(model, args.output_dir)
    distributed.cleanup()


if __name__ == "__main__":
    main()
