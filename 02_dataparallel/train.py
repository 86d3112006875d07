"""Stage 02: several GPUs from one process, with nn.DataParallel.

Teaches: the smallest change that uses every GPU of a node. One process drives all visible GPUs:
each step, nn.DataParallel copies the model to every GPU, splits the batch across them, and gathers
the outputs and gradients back on GPU 0. Simple, but that one process and GPU 0 become the
bottleneck as GPUs are added: stage 03 removes it.

Launch (one process, all visible GPUs; a single GPU or the CPU also work):
    python 02_dataparallel/train.py --epochs 1
    sbatch job.slurm --epochs 3                  # from 02_dataparallel/

Changes from stage 01: the model is wrapped in nn.DataParallel when more than one GPU is visible.
--batch-size stays the global batch: with 4 GPUs, each computes 16 of the 64 images. Nothing else.

Reading it: the task (--task FILE; MNIST by default) gives the model, data and loss. A line marked
`guard` (common/guards/) or `option:` (common/options/) can be skipped: a default run reads alike.

Expect: the accuracy of stage 01 (same global batch, same recipe); images/s grows little with GPUs
on a model this small.
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
import torch.nn.functional as F
from torch import nn

from common import checkpoint, cli, data, distributed, metrics, optim, sampling
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
    order = sampling.Shuffled(train_set, args.seed)  # a new order each epoch: set_epoch()
    train_sampler = resuming.Resumable(order, args.batch_size) if resume else order  # option
    # whole batches of decoded images; option: --loader, --num-workers, a task's own data set
    loader = data.loader if data.batched(train_set, args) else loaders.pipeline(args, task)
    train_loader = loader(train_set, train_sampler, args.batch_size, device)
    val_loader = loader(val_set, range(len(val_set)), args.test_batch_size, device)
    test_loader = loader(test_set, range(len(test_set)), args.test_batch_size, device)
    distributed.banner(args, rank, local_rank, world_size, device, train_loader)
    # option: a task's own metric, loss() or speed unit; else accuracy, in samples/s
    metric = hooks.metric(task, args) if hooks.OWN & vars(task).keys() else metrics.Metric()
    log = metrics.Log(args.output_dir, world_size, metric)
    model = task.model(args).to(device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        # one process, every visible GPU: each batch split across them, gradients summed on GPU 0
        model = nn.DataParallel(model)
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
        validated = evaluate(step, val_loader, len(val_set), guard)
        tested = evaluate(step, test_loader, len(test_set), guard)
        totals = metrics.Epoch(trained, validated, tested).tensor()  # one copy (and all-reduce)
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
