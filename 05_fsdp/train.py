"""Stage 05: FSDP2: a model too big for one GPU, sharded across the ranks.

Teaches: DDP keeps whole weights, gradients and optimizer state on each GPU; FSDP (fully_shard)
keeps 1/world size of each per rank and gathers a block's weights just before it runs: memory per
GPU falls with the GPUs, for about 1.5x DDP's traffic; sharded checkpoints resume on any GPU count.

Launch (from 05_fsdp/; srun starts one task per GPU on every node, as in stage 04):
    sbatch job.slurm --epochs 3
    sbatch job.slurm --model wideresnet --dataset cifar100 --amp --checkpoint-activations

Changes from stage 04: built on the meta device, each rank filling its own shards; fully_shard per
block and the root, not DDP; sharded checkpoints; a memory line. Options: FSDP's precision policies
under --amp (BatchNorm a unit of its own), --compile per block, --grad-accum, recomputation.

Reading it: the task (--task FILE; MNIST by default) gives the model, data and loss. A line marked
`guard` (common/guards/) or `option:` (common/options/) can be skipped: a default run reads alike.
"""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/ sits beside the stages
if importlib.util.find_spec("common"):
    from common.guards import early

    early.start(__file__)  # guard: before torch: an old one, or a stop in its imports, is one line
else:  # this folder was copied without common/
    here = Path(__file__).resolve().parent  # or `pip install --no-deps -e <repository>`
    sys.exit(f"error: no common/ beside {here}: copy the repository's common/ there")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

from common import checkpoint, cli, data, distributed, meta, metrics, optim, sharded
from common.guards import rails  # guard rails: each `guard` line says what it guards; skip them
from common.models import blocks, gathered, norms
from common.options import amp, export, flags, holdout, hooks, large, loaders, resuming


def train_step(step, x, y):
    loss = step.loss_fn(step.model(x), y)
    loss.backward()
    step.optimizer.step()
    return loss.detach()


@metrics.profile  # a no-op unless kernprof -l (or LINE_PROFILE=1) drives the run
def train(step, loader, epoch, sums, args, guard):
    step.model.train()
    # sums: on the device, no GPU -> CPU sync per step; a resumed epoch's start from its part before
    for batch_idx, (x, y) in enumerate(loader):
        x, y = data.to_device((x, y), step.device)  # tensors, or dicts and lists of them
        step.optimizer.zero_grad(set_to_none=True)
        loss = step.run(step, x, y)  # train_step, or what --amp or --compile made of it
        sums.loss += loss * data.count(y)
        sums.samples += data.count(y)
        if batch_idx % args.log_interval == 0:
            metrics.progress(epoch, batch_idx, len(loader), loss)
        guard.end_of_step(epoch, batch_idx, sums)  # guard: a diverged loss stops; a signal saves
        if args.dry_run:
            break
    return sums


@torch.no_grad()
def evaluate(step, loader, samples, guard):
    """`samples`: this rank's own of the loader's samples; the padding after them counts nowhere"""
    distributed.average_buffers(step.model)  # BatchNorm: the same running statistics on every rank
    step.model.eval()
    sums = metrics.Sums.zeros(step.device)
    for x, y in loader:
        x, y = data.to_device((x, y), step.device)
        output, n = step.model(x), min(data.count(y), samples)  # each forward on every rank (FSDP)
        output, y, samples = data.first(output, n), data.first(y, n), samples - n  # padding: cut
        loss = step.loss_fn(output, y)  # on every rank, of none too: a collective in it lines up
        if n:  # (the mean over no samples is nan)
            sums.loss += loss * n
            sums.score = sums.score + step.score(output, y)  # a task's totals: a row, from 0
            sums.samples += n
        guard.end_of_batch()  # guard: a stop saves here too
    return sums


def main(guard):
    args, task = cli.parse_args(groups=[flags.add, flags.large])  # task: the model and data
    guard.start(args)  # guard: one run per folder, a sound launch, a bounded rendezvous
    rank, local_rank, world_size, device = distributed.setup(args)
    torch.manual_seed(args.seed)

    train_set, test_set = task.datasets(args)
    val_set = []  # part of the training set, held out with --val-fraction
    if args.val_fraction:  # option: --val-fraction
        train_set, val_set = holdout.split(train_set, args.val_fraction, args.seed)
    guard.agree(train_set, val_set, test_set, task)  # guard: the same data on every rank
    resume = checkpoint.latest(args, checkpoint.SHARDED)  # --resume's, or after a requeue
    # each rank draws its own 1/world_size of every epoch, in an order all ranks agree on
    order = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    train_sampler = resuming.Resumable(order, args.batch_size) if resume else order  # option
    # whole batches of decoded images; option: --loader, --num-workers, a task's own data set
    loader = data.loader if data.batched(train_set, args) else loaders.pipeline(args, task)
    batch_size = args.batch_size // world_size  # --batch-size is the global batch
    train_loader = loader(train_set, train_sampler, batch_size, device)
    # evaluation: a shard per rank, padded to as many batches on every rank; padding counts nowhere
    val_shard, test_shard = (data.shard(len(s), rank, world_size) for s in (val_set, test_set))
    val_loader = loader(val_set, val_shard.indices, args.test_batch_size, device)
    test_loader = loader(test_set, test_shard.indices, args.test_batch_size, device)
    distributed.banner(args, rank, local_rank, world_size, device, train_loader)
    # option: a task's own metric, loss() or speed unit; else accuracy, in samples/s
    metric = hooks.metric(task, args) if hooks.OWN & vars(task).keys() else metrics.Metric()
    log = metrics.Log(args.output_dir, world_size, metric)
    with torch.device("meta" if getattr(task, "META", True) else "cpu"):  # shapes: no whole model
        model = task.model(args)
    units = getattr(task, "blocks", blocks)(model)  # the task's, else Sequential/ModuleList layers
    mesh = distributed.mesh(args, world_size, device)  # HSDP: shard in a node, replicate across
    optim.memory(model, args, world_size, mesh)
    if args.checkpoint_activations or args.compile:  # option: recomputed in the backward, compiled
        large.per_unit(units, args, log)
    block_policy, norm_policy, root_policy = amp.policies(device, args)  # --amp: bf16 over fp32
    if dist.is_initialized():  # a plain `python train.py` has no process group: nothing to wrap
        if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        for norm in norms(model) if args.amp else []:  # --amp: BatchNorm a unit of its own, fp32
            fully_shard(norm, mesh=mesh, mp_policy=norm_policy)
        for block in gathered(units):  # its weights are gathered just before it runs, then freed
            fully_shard(block, mesh=mesh, mp_policy=block_policy)
        fully_shard(model, mesh=mesh, mp_policy=root_policy)  # the rest; grads reduce-scattered
    meta.materialise(model, device, task)  # each rank fills its shards: 01's weights
    optimizer = optim.optimizer(args, model.parameters())
    scheduler = optim.scheduler(args, optimizer)
    loss_fn = getattr(task, "loss", F.cross_entropy)  # the task's, else cross-entropy on logits
    states = dict(model=model, optimizer=optimizer, scheduler=scheduler, log=log)
    step = optim.Step(model, device, optimizer, loss_fn, metric.score, train_step)
    if flags.LARGE.items() - vars(args).items() or hooks.RECIPE & vars(task).keys():  # option
        step, scheduler = hooks.recipe(step, states, task, args)  # the flags' or the task's recipe
    guard.resume(resume, states, sharded=True)  # guard: this run's, whole; saves on a stop
    # option: --resume, a requeue: the checkpoint's state, an epoch saved part-way at its sample
    start_epoch = resuming.restore_sharded(resume, states, train_sampler) if resume else 1
    for epoch in range(start_epoch, args.epochs + 1):
        if args.target is not None and holdout.reached(log, args.target, args.patience):
            break  # option: --target; the same all-reduced rows on every rank
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one after a resume
        so_far = log.start(epoch, device)  # the clock and sums, from a part before a stop if any
        trained = train(step, train_loader, epoch, so_far, args, guard)
        seconds = log.seconds(device)  # an interrupted epoch's time includes its part before
        validated = evaluate(step, val_loader, val_shard.samples, guard)
        tested = evaluate(step, test_loader, test_shard.samples, guard)
        totals = metrics.Epoch(trained, validated, tested).tensor()  # one copy (and all-reduce)
        if dist.is_initialized():
            dist.all_reduce(totals)  # sums over the ranks: losses, samples, correct answers
        sums = metrics.Epoch.read(totals)  # by name again: training, validation, test
        guard.check_epoch(epoch, sums)  # guard: nothing non-finite is logged or saved
        log.epoch(epoch, scheduler.get_last_lr()[0], seconds, sums)
        scheduler.step()
        sharded.save(args.output_dir, epoch, states)  # every rank writes its shards
    log.summary()
    if args.save_model:  # option: --save-model: the weights alone, for inference
        export.save_model(model, args.output_dir, guard)
    distributed.cleanup()


if __name__ == "__main__":
    rails.run(main)  # guard: any failure ends the run with one line, not a traceback
