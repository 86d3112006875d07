"""Stage 03: one process per GPU with DDP, started by torchrun.

Teaches: the way PyTorch scales. torchrun starts one process per GPU; each holds a full copy of the
model, trains on its own shard of every epoch (DistributedSampler) and, during backward(), averages
its gradients with all the others (all-reduce), so every copy takes the same optimizer step. No
process is a bottleneck, and the same script scales past one node (stage 04).

Launch:
    torchrun --standalone --nproc_per_node=2 03_ddp_single_node/train.py --epochs 1
    python 03_ddp_single_node/train.py --epochs 1     # no launcher: a single process
    sbatch job.slurm --epochs 3                        # from 03_ddp_single_node/

Changes from stage 02: DataParallel is gone; a process group (NCCL on GPUs, gloo on CPUs) is made
by common.distributed.setup(); the model is wrapped in DDP; RandomSampler becomes
DistributedSampler, reshuffled every epoch by set_epoch(); each rank computes --batch-size / world
size images per step; evaluation is split across the ranks and its sums are all-reduced, so every
test image counts once, after each rank's BatchNorm statistics are averaged (they drift apart).

Reading it: the task (--task FILE; MNIST by default) gives the model, data and loss. A line marked
`guard` (common/guards/) or `option:` (common/options/) can be skipped: a default run reads alike.

Expect: the accuracy of stage 01 at the same global batch; images/s in total grows with the GPUs.
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common import checkpoint, cli, data, distributed, metrics, optim
from common.guards import rails  # guard rails: each `guard` line says what it guards; skip them
from common.options import amp, compiling, export, flags, holdout, hooks, loaders, resuming


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
    args, task = cli.parse_args(groups=[flags.add])  # task: the model and data (--task FILE)
    guard.start(args)  # guard: one run per folder, a sound launch, a bounded rendezvous
    rank, local_rank, world_size, device = distributed.setup(args)
    torch.manual_seed(args.seed)

    train_set, test_set = task.datasets(args)
    val_set = []  # part of the training set, held out with --val-fraction
    if args.val_fraction:  # option: --val-fraction
        train_set, val_set = holdout.split(train_set, args.val_fraction, args.seed)
    guard.agree(train_set, val_set, test_set, task)  # guard: the same data on every rank
    resume = checkpoint.latest(args)  # --resume's, or after a requeue (None: start afresh)
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
    model = task.model(args).to(device)
    if dist.is_initialized():  # a plain `python train.py` has no process group: nothing to wrap
        if args.sync_bn:  # BatchNorm statistics over the global batch, not each rank's share
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        ids = [device] if device.type == "cuda" else None  # gradients: averaged during backward(),
        model = DDP(model, device_ids=ids, gradient_as_bucket_view=True)  # overlapped, in buckets
    optimizer = optim.optimizer(args, model.parameters())
    scheduler = optim.scheduler(args, optimizer)
    loss_fn = getattr(task, "loss", F.cross_entropy)  # the task's, else cross-entropy on logits
    states = dict(model=model, optimizer=optimizer, scheduler=scheduler, log=log)
    step = optim.Step(model, device, optimizer, loss_fn, metric.score, train_step)
    if flags.LESSON.items() - vars(args).items() or hooks.RECIPE & vars(task).keys():  # option
        step, scheduler = hooks.recipe(step, states, task, args)  # the flags' or the task's recipe
    step = amp.mixed(step, states) if args.amp else step  # option: --amp, bf16 (fp16 scaled)
    step = compiling.compiled(step, log, args) if args.compile else step  # option: --compile
    guard.resume(resume, states)  # guard: this run's checkpoint, whole; saves on a stop from here
    # option: --resume, a requeue: the checkpoint's state, an epoch saved part-way at its sample
    start_epoch = resuming.restore(resume, states, train_sampler) if resume else 1
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
        checkpoint.save(args.output_dir, epoch, states)
    log.summary()
    if args.save_model:  # option: --save-model: the weights alone, for inference
        export.save_model(model, args.output_dir, guard)
    distributed.cleanup()


if __name__ == "__main__":
    rails.run(main)  # guard: any failure ends the run with one line, not a traceback
