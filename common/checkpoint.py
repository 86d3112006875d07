"""Checkpoints: every finished epoch survives a kill, a time limit or a requeue.

Global rank 0 writes --output-dir/checkpoint.pt at the end of every epoch, atomically: a crash
mid-write leaves the previous checkpoint intact, and the one before stays as checkpoint-previous.pt.
Rank 0 also reads it back and hands it to every rank, so the output folder need not be on a filesystem
that every node sees. Files are loaded with `weights_only=True`: a checkpoint holds tensors and plain
values, never code to run.

Stage 05's model is sharded: every rank writes its own shard with torch.distributed.checkpoint into a
new folder <output-dir>/epoch-N, and rank 0 then points the link <output-dir>/checkpoint at it, which
is atomic too (the last two folders stay). Such a checkpoint loads at any world size: each rank reads
the pieces its new shard needs, so every node must see the folder.

A run resumes by itself when Slurm requeued or restarted its job (SLURM_RESTART_COUNT > 0, same job
id, same output folder) or torchrun restarted its workers; otherwise only with --resume [PATH], and
only with the options that define the run unchanged (common.cli.DEFINING). The guard rails of the
output folder (its lock, atomic and finite writes, damaged or planted files) are in common/rundir.py.
"""

import os
import shutil
import time
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from common import cli, divergence, preemption, resumable, rundir
from common.distributed import cleanup, print0, stop
from common.environment import integer, is_rank0
from common.resumable import PREVIOUS, SHARDED, WHOLE  # the file names, shared with the resume checks

# stage 05 run by plain `python train.py` saves and loads its sharded checkpoints in one process, as meant
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")


def unwrap(model):
    """The plain model inside DataParallel or DistributedDataParallel: weights saved from it carry no
    `module.` prefix, so any stage loads them."""
    return getattr(model, "module", model)


def restarts(env=os.environ):
    """(Slurm's restart count of this job, torchrun's of its workers)."""
    return integer("SLURM_RESTART_COUNT", 0, env=env), integer("TORCHELASTIC_RESTART_COUNT", 0, env=env)


class Run(NamedTuple):
    """What a checkpoint saves and restores, passed whole to save(), resume() and step()."""

    args: object
    model: object
    optimizer: object
    scheduler: object
    scaler: object
    log: object  # metrics.Log: the rows so far, and the clock of an epoch cut short
    sampler: object  # resumable.Sampler: where in its epoch a resumed run starts
    sharded: bool = False  # stage 05: every rank writes its own shards

    def first_step(self):
        """The step this epoch starts at: 0, or where an interrupted run stopped."""
        return self.sampler.skipped() // self.args.batch_size


def save(run, epoch, step=0, totals=None):
    """The end of epoch `epoch`, or with `step`, the middle of it: `totals` (this rank's training loss and
    samples so far) and the time so far go with it, so its row in metrics.csv counts the whole epoch."""
    started = time.monotonic()
    partial = run.log.partial(epoch, totals) if step else None  # all-reduced: every rank calls save()
    (save_sharded if run.sharded else save_whole)(run, run_state(run, epoch, step, partial))
    preemption.saved(time.monotonic() - started)


def step(run, epoch, step, totals):
    """The end of every training step. Where a signal stops the run (common/preemption.py), save it here and
    end it; with --checkpoint-minutes, save it here once that much time has passed since the last save, at a
    step every rank agrees on."""
    count = epoch * 2**32 + step  # a step count that grows across epochs
    if preemption.check(count):
        save(run, epoch, step, totals)
        print0(f"saved at epoch {epoch}, step {step}: resume with --resume ({preemption.signalled()})")
        cleanup()
        raise SystemExit(preemption.exit_code())
    if run.args.checkpoint_minutes and preemption.due(run.args.checkpoint_minutes, count):
        save(run, epoch, step, totals)
        print0(f"saved at epoch {epoch}, step {step} (--checkpoint-minutes {run.args.checkpoint_minutes})")


def save_whole(run, state):
    """Stages 01-04: rank 0 writes the weights, the optimizer state and the run state to checkpoint.pt."""
    args, epoch = run.args, state["epoch"]
    state |= {"model": unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict()}
    divergence.check_weights(state, f"epoch {epoch} left weights that are", args.output_dir)
    if is_rank0():
        with rundir.atomic(args.output_dir / WHOLE, keep=args.output_dir / PREVIOUS) as f:  # the last two stay
            torch.save(state, f)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves the epoch with its checkpoint complete on disk


def run_state(run, epoch, step, partial):
    """What a checkpoint holds besides the weights and the optimizer state: plain values and small tensors."""
    return {
        "epoch": epoch,
        "step": step,  # 0: the epoch is complete; else the steps of it done, and the sums and time of them
        "partial": partial,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        },
        "metrics": run.log.rows,
        "flags": cli.defining(run.args),
        "data": run.sampler.fingerprint(),  # what it was trained on: a resume on other data is refused
    }


def save_sharded(run, state):
    """Stage 05: each rank writes its shards of the weights and optimizer state into <output-dir>/epoch-N
    (epoch-N-step-S mid-epoch; torch.distributed.checkpoint), rank 0 adds state.pt and then switches the link
    <output-dir>/checkpoint to the new folder: a kill before the switch leaves the previous checkpoint whole."""
    from torch.distributed import checkpoint as dcp  # here: the stages that do not shard skip the import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    args, epoch = run.args, state["epoch"]
    weights, optimizer_state = get_state_dict(run.model, run.optimizer)  # this rank's shards, named as in the model
    device = next(run.model.parameters()).device  # each rank sees its own shards: the verdict is all-reduced there
    divergence.check_weights(
        [weights, optimizer_state], f"epoch {epoch} left weights that are", args.output_dir, device
    )
    folder = args.output_dir / (f"epoch-{epoch}-step-{state['step']}" if state["step"] else f"epoch-{epoch}")
    if is_rank0():
        shutil.rmtree(folder, ignore_errors=True)  # what a save killed half-way left behind
    if dist.is_initialized():
        dist.barrier()
    try:  # tensors only: DCP loads any other item with torch.load(weights_only=False); rundir.metadata refuses it
        dcp.save({"model": weights, "optimizer": optimizer_state["state"]}, checkpoint_id=folder)
    except (OSError, dcp.CheckpointException) as err:  # every rank gets the failures of all
        free = shutil.disk_usage(args.output_dir).free / 2**20
        stop(f"error: could not write {folder}: {rundir.describe(err)} ({free:.0f} MiB free there): the previous "
             "checkpoint is kept; free some space or choose another --output-dir, then resume")  # fmt: skip
    if is_rank0():
        with rundir.atomic(folder / "state.pt") as f:
            torch.save(state | {"param_groups": optimizer_state["param_groups"]}, f)  # plain values: weights_only
        link = args.output_dir / "checkpoint.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(folder.name)
        os.replace(link, args.output_dir / SHARDED)  # atomic: the old checkpoint or the new one
        for old in resumable.epochs(args.output_dir)[2:]:  # the last two complete checkpoints stay
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has switched the link
        rundir.check_shared(args.output_dir, folder)  # a resume at another world size reads every rank's shards


def resume(run):
    """Continue from this run's checkpoint (or --resume PATH), if there is one to continue: returns the first
    epoch to run; part-way through it where the checkpoint was saved mid-epoch. From here on, SIGTERM and
    SIGUSR1 stop the run at the end of a step (step()). Stages 01-04 resume from checkpoint.pt; stage 05 from
    its sharded checkpoint, saved at any world size, or with --resume from a checkpoint.pt of stages 01-04."""
    preemption.catch(run.args.dist_timeout)
    args, name = run.args, SHARDED if run.sharded else WHOLE
    restarted = any(restarts())
    if dist.is_initialized():  # torch does not count a restart on a node whose own workers had not failed:
        everyone = [None] * dist.get_world_size()  # one for any rank is one for all, so that every rank resumes
        dist.all_gather_object(everyone, restarted)
        restarted = any(everyone)
    box = [None, None]
    if is_rank0():
        try:
            box[0] = resumable.find(args, name, restarted, run.sampler.fingerprint())  # or why it cannot continue
        except SystemExit as verdict:  # for every rank: they end together, rank 0 says why
            box[1] = verdict.code
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    state, verdict = box
    if verdict:
        stop(verdict)
    if state is None:
        return 1
    try:
        (load_sharded if run.sharded else load_whole)(state, run.model, run.optimizer)
    except (RuntimeError, ValueError, KeyError) as err:
        stop(f"error: the checkpoint does not match this model: {str(err).splitlines()[0][:300]}")
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    run.log.restore(state["metrics"], state["epoch"], state.get("partial"))
    slurm, torchrun = restarts()
    how = f"(Slurm restart {slurm}, torchrun restart {torchrun})"
    epoch, step = state["epoch"], state.get("step", 0)
    if not step:
        print0(f"resumed after epoch {epoch} {how}")
        return epoch + 1
    run.sampler.resume_at(epoch, step * args.batch_size)  # the samples of those steps, over all ranks
    print0(f"resumed at epoch {epoch}, step {step} {how}")
    return epoch


def load_whole(state, model, optimizer):
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def load_sharded(state, model, optimizer):
    """Into a sharded model: each rank reads from the folder the pieces of its own shards (at any world
    size: the checkpoint records where each piece lies), or takes its shards of a whole checkpoint.pt."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if state["folder"]:
        weights, optimizer_state = get_state_dict(model, optimizer)  # the shapes to fill, this rank's shards
        pieces = {"model": weights, "optimizer": optimizer_state["state"]}
        try:
            dcp.load(pieces, storage_reader=rundir.reader(state["folder"]))  # .metadata read, running nothing
        except dcp.CheckpointException as err:  # a shard missing (a folder not shared), of another model, or planted
            stop(
                f"error: cannot load the checkpoint {state['folder']}: {rundir.describe(err)}: resume from a complete one"
            )
        optimizer_state = {"state": pieces["optimizer"], "param_groups": state["param_groups"]}
        set_state_dict(model, optimizer, model_state_dict=pieces["model"], optim_state_dict=optimizer_state)
        return
    names = [name for name, _ in model.named_parameters()]  # optimizer.state_dict() numbers them in this order
    saved = state["optimizer"]
    optimizer_state = {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [group | {"params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))  # fmt: skip


def save_model(model, output_dir):
    """The whole weights, as stage 01's model names them: from any stage, a file any stage loads."""
    weights = unwrap(model).state_dict()
    if any(hasattr(w, "to_local") for w in weights.values()):  # stage 05's DTensors: gather the shards on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # every rank's own weights, or rank 0's whole ones (the others then have none)
    divergence.check_weights(weights, "the trained weights are", output_dir)
    if is_rank0():
        with rundir.atomic(output_dir / "model.pt") as f:
            torch.save(weights, f)
