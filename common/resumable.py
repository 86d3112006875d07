"""Guard rail: a resumed run is the same run, and a fresh one overwrites nothing. Before any rank loads a
checkpoint, rank 0 decides which one this run continues, or ends it with one line saying why not: a
fresh run into a folder that holds a checkpoint; a changed option that defines the run, or other training
data; a checkpoint already past --epochs; a checkpoint of the other kind (whole, sharded); a damaged one,
with the complete one before it to resume from instead; anything but a file (a FIFO would block the read
for ever). common/checkpoint.py calls find() at the one line where it resumes. Sampler lets the stages
resume an epoch part-way, at the sample where it stopped."""

import math
import pickle
import re

import torch
from torch.utils.data.distributed import DistributedSampler

from common import cli, data, rundir

WHOLE, SHARDED = "checkpoint.pt", "checkpoint"  # stages 01-04's file; stage 05's link to its newest epoch-N
PREVIOUS = "checkpoint-previous.pt"  # the epoch before checkpoint.pt's: a damaged latest leaves one to resume from


class Unusable(Exception):
    """A checkpoint that cannot be resumed from, and why."""


def epochs(output_dir):
    """The sharded checkpoint folders in output_dir, newest first: epoch-N (the end of epoch N) and
    epoch-N-step-S (S steps into it)."""

    def position(folder):
        found = re.fullmatch(r"epoch-(\d+)(?:-step-(\d+))?", folder.name)
        return (int(found[1]), int(found[2]) if found[2] else math.inf) if found else (-1, 0)

    return sorted(output_dir.glob("epoch-*"), key=position, reverse=True)


def find(args, name, restarted, fingerprint):
    """Rank 0: the state of the checkpoint to resume from (a stage 05 folder: its state.pt, with "folder"
    added), or None to start afresh; a SystemExit saying why where it cannot. `fingerprint`: that of the
    training set this run reads (Sampler.fingerprint())."""
    if args.resume is None and not restarted:
        for found in (args.output_dir / WHOLE, args.output_dir / SHARDED):
            if found.exists():  # whole or sharded, of any stage: a fresh run would overwrite its metrics.csv
                raise SystemExit(f"error: {found} holds the checkpoint of an earlier run: add --resume to continue "
                                 "it (in the stage that wrote it), or choose another --output-dir")  # fmt: skip
        return None
    own = args.output_dir / name
    path = own if args.resume in (None, True) else args.resume
    if not path.exists():
        if args.resume is None:  # restarted before its first checkpoint
            return None
        other = args.output_dir / (WHOLE if name == SHARDED else SHARDED)
        held = f" (it holds {other.name}, of {'stages 01-04' if other == args.output_dir / WHOLE else 'stage 05'})"
        raise SystemExit(f"error: no {path.name} in {path.parent} to resume from{held if other.exists() else ''}")
    try:
        state = load(path)
    except (Unusable, rundir.Planted) as problem:
        hint = fallback(args.output_dir, path.resolve()) if path == own else ""
        if isinstance(problem, rundir.Planted):  # nothing of it was run: say so, and what to resume from instead
            raise SystemExit(f"error: {problem}; delete it or resume from another checkpoint{hint}") from None
        raise SystemExit(f"error: {problem}{hint or ': delete it or use another'}") from None
    if state["folder"] and name == WHOLE:
        raise SystemExit(f"error: {path} is a sharded checkpoint of stage 05: resume it there, or export its "
                         "weights with its --save-model")  # fmt: skip
    if problem := mismatch(state, args, fingerprint):
        raise SystemExit(f"error: {path} {problem}")
    return state


def mismatch(state, args, fingerprint):
    """Why this run cannot continue the one a checkpoint's `state` holds, or None. A checkpoint from before an
    option (or the data's fingerprint) was recorded does not record it: what it records must match."""
    now = cli.defining(args)
    differ = [f"--{k.replace('_', '-')} {v} (now {now.get(k)})" for k, v in state["flags"].items() if now.get(k) != v]
    if differ:
        return f"was written with {', '.join(differ)}: resume with the same options, or use another --output-dir"
    if state.get("data", fingerprint) != fingerprint:  # <images>-<hash> (common.data.fingerprint)
        return (f"was trained on other data: its {args.dataset} training set was {state['data']}, here {fingerprint} "
                f"in --data-dir {args.data_dir}: resume on the data it was trained on, or use another --output-dir")  # fmt: skip
    epoch, step = state["epoch"], state.get("step", 0)
    if args.epochs < epoch:  # "done", and --save-model would export more epochs than asked for, or a part of one
        return (f"holds epoch {epoch}{f', step {step}' if step else ''}, past --epochs {args.epochs}: nothing to "
                f"do; give --epochs {epoch if step else epoch + 1} or more to continue it")  # fmt: skip
    return None


def load(path):
    """A checkpoint's run state: checkpoint.pt, or a sharded folder's state.pt with its shards checked and
    "folder" added; Unusable if it is damaged or no training checkpoint, rundir.Planted if it would run code."""
    folder = path.resolve() if path.is_dir() else None
    file = folder / "state.pt" if folder else path
    if file.exists() and not file.is_file():  # a FIFO blocks the read for ever, where a signal is only noted
        raise Unusable(f"{file} is not a regular file (a FIFO, a socket or a device)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # it names what weights_only refuses to call: a pickle that would run code
        raise rundir.Planted(f"{file} is not a checkpoint this repository wrote (torch.load with weights_only=True "
                             "refuses it): it may be planted") from None  # fmt: skip
    except Exception as err:  # a truncated file
        raise Unusable(f"{path} is not a checkpoint this code wrote, or is damaged ({type(err).__name__})") from None
    if not (isinstance(state, dict) and {"epoch", "flags"} <= state.keys() and ("model" in state or folder)):
        raise Unusable(f"{path} is not a training checkpoint (a --save-model file holds weights only): give "
                       "<output-dir>/checkpoint.pt")  # fmt: skip
    if folder and (problem := rundir.damage(folder)):
        raise Unusable(f"{path} is damaged: {problem}")
    return state | {"folder": folder}


def fallback(output_dir, damaged):
    """The complete checkpoint before the damaged latest one in output_dir, as a hint: '' if there is none."""
    candidates = [output_dir / PREVIOUS] if damaged.is_file() else [f for f in epochs(output_dir) if f != damaged]
    for path in candidates:
        try:
            state = load(path)
        except (Unusable, rundir.Planted, FileNotFoundError):
            continue
        return f": the checkpoint of epoch {state['epoch']} is complete: resume from it with --resume {path}"
    return ""


class Sampler(torch.utils.data.Sampler):
    """A training sampler whose epochs can be resumed part-way. set_epoch(epoch) makes the epoch's order, the
    same in a resumed run; resume_at(epoch, samples) skips, in that epoch, the first `samples` of the order
    counted over all ranks (steps x global batch). A DistributedSampler deals the ranks every world_size-th
    sample of one order, so the first samples of that order are those seen, whatever the world size: a run
    resumed at another deals out the rest anew, and no sample is skipped or seen twice."""

    def __init__(self, sampler, seed):
        self.sampler, self.seed, self.epoch, self.skip = sampler, seed, 0, (0, 0)
        self.digest = None  # the fingerprint of the data set it draws from, once asked for

    def fingerprint(self):
        """The data set it draws from, as common.data.fingerprint() tells data sets apart: a checkpoint records
        what it was trained on, and a run on other data does not continue it."""
        if self.digest is None:
            drawn = self.sampler.dataset if isinstance(self.sampler, DistributedSampler) else self.sampler.data_source
            self.digest = data.fingerprint(drawn)
        return self.digest

    def set_epoch(self, epoch):
        self.epoch = epoch
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        else:  # a RandomSampler draws its order from its generator
            self.sampler.generator.manual_seed(self.seed + epoch)

    def resume_at(self, epoch, samples):
        self.skip = (epoch, samples)

    def skipped(self):
        """The samples of this epoch that an earlier run already trained on, over all ranks."""
        return self.skip[1] if self.skip[0] == self.epoch else 0

    def __len__(self):
        return len(self.sampler)

    def __iter__(self):
        skip, sampler = self.skipped(), self.sampler
        if not skip:
            yield from sampler
        elif isinstance(sampler, DistributedSampler):  # the whole epoch's order, as one rank would draw it
            whole = DistributedSampler(
                sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed
            )
            whole.set_epoch(self.epoch)
            rest = list(whole)[skip:]
            rest += rest[: -len(rest) % sampler.num_replicas]  # padded as DistributedSampler pads
            yield from rest[sampler.rank :: sampler.num_replicas]
        else:
            yield from list(sampler)[skip:]
