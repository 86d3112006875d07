"""Guard rail: a resumed run is the same run, and a fresh one overwrites nothing. Before any rank loads a
checkpoint, rank 0 decides which one this run continues, or ends it with one line saying why not: a
fresh run into a folder that holds another run's output; a changed option that defines the run; a checkpoint
of the other kind (whole, sharded); a damaged one, with the complete one before it to resume from instead.
A run resumes by itself when Slurm requeued or restarted its job (SLURM_RESTART_COUNT > 0) or torchrun
restarted its workers, and its folder's manifest names that launch (common/guards/ownership.py); otherwise
only with --resume [PATH]."""

import os
import pickle

import torch.distributed as dist

from common import checkpoint
from common.checkpoint import SHARDED, WHOLE
from common.distributed import print0
from common.environment import is_rank0, restarts
from common.guards import links, ownership, recorded, safeload
from common.guards.bounded import Refused, torch_file
from common.guards.ending import Refusal, stop
from common.guards.links import epochs
from common.guards.recorded import mismatch
from common.guards.safeload import Planted, damage, tensors
from common.options.resuming import read

PREVIOUS = "checkpoint-previous.pt"  # the epoch before checkpoint.pt's: a damaged latest leaves one to resume from


def check_whole(path, own, state):
    """Stages 01-04 resume a checkpoint.pt alone: not stage 05's folder, nor the file a run left in its own folder
    for stage 05, which went on from it: that would train its epochs again beside stage 05's newer save."""
    if state["folder"]:
        raise Refusal(
            f"error: {path} is a sharded checkpoint of stage 05: resume it there, or export its "
            "weights with its --save-model"
        )
    link, at = path.with_name(SHARDED), (state["epoch"], state["step"] or float("inf"))
    if path == own and link.is_symlink() and links.position(link.resolve()) > at:
        raise Refusal(
            f"error: {path} holds epoch {at[0]}, but the run went on in stage 05 to {os.readlink(link)} ({link}): "
            "continue it there (05_fsdp/train.py --resume), or start a new run in another --output-dir"
        )


def again(args, manifest, fingerprints):
    """A fresh run into the folder of a run that saved no checkpoint (stopped or killed before its first, or in
    its first write) but logged rows: with the options and data it recorded, it is that run started again, and
    writes its rows anew (returns its id); else one line, as for another run's output."""
    who = ownership.whose(manifest)
    if problem := mismatch(manifest["record"], {"epoch": 1, "step": 0}, args, fingerprints, "run it again"):
        raise Refusal(f"error: {args.output_dir} holds the metrics of {who}, which saved no checkpoint and {problem}")
    print0(f"{who} saved no checkpoint: it starts again from epoch 1")
    return manifest["run"]


def saved(output_dir):
    """Does output_dir hold a checkpoint a resume reads: whole, a stage 05 folder its links name, or one with its
    state.pt, written after its shards (its links lost: a copy that skips them, rsync without -l)? A folder without
    was left by a save killed half-way."""
    linked = any(os.path.lexists(output_dir / n) for n in (WHOLE, SHARDED, PREVIOUS, f"{SHARDED}-previous"))
    return linked or any((folder / "state.pt").is_file() for folder in epochs(output_dir))


class Unusable(Exception):
    """A checkpoint that cannot be resumed from, and why."""


def state_to_resume(args, path, sharded, record, declared=None):
    """Every rank: whether this run may continue the checkpoint at `path` the lesson chose (checkpoint.latest();
    None: start afresh in its folder); where it may not, every rank ends with rank 0's reason. Returns the state
    rank 0 checked (None afresh), handed to all. Rank 0 has made the folder this run's (ownership.claim()), its
    manifest recording `record` (the options that define the run, its data's fingerprints, the model's size), before
    anyone writes there."""
    restarted = checkpoint.restarted()  # on every rank alike
    box = [None, None]
    if is_rank0():
        try:
            box[0], run = find(args, path, SHARDED if sharded else WHOLE, restarted, record, declared)
            ownership.claim(args.output_dir, run, sharded, record, args.save_model)
        except Refusal as verdict:  # for every rank: they end together, rank 0 says why
            box[1] = verdict.code
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    state, verdict = box
    if verdict:
        stop(verdict)
    if state is not None:
        slurm, torchrun = restarts()
        at = f"at epoch {state['epoch']}, step {state['step']}" if state["step"] else f"after epoch {state['epoch']}"
        print0(f"resumed {at} (Slurm restart {slurm}, torchrun restart {torchrun})")
        recorded.say_world(state["run_record"], record)
    return state


def same_columns(state, fields):
    """The rows of metrics.csv that the checkpoint `state` holds fit this run's columns (`fields`, metrics.Log's):
    they do not where the task's metric was renamed since (mae, then l1); one line, on every rank alike. A row of
    an older version may lack a column, left empty."""
    rows = (state or {}).get("log", {}).get("rows")
    if rows and set(rows[0]) - set(fields):
        stop(
            f"error: the checkpoint's rows of metrics.csv hold {', '.join(sorted(set(rows[0]) - set(fields)))}, "
            f"where this run's task logs {', '.join(sorted(set(fields) - set(rows[0])))}: resume with the task's "
            "metric as it was trained, or use another --output-dir"
        )


def find(args, path, name, restarted, fingerprints, declared=None):
    """Rank 0: the state of the checkpoint at `path` (a stage 05 folder: its state.pt, with "folder" added), or
    None to start afresh, and the id of the run it continues (None: a new one); a Refusal saying why where
    this run may not. `name`: the stage's own checkpoint in --output-dir; `fingerprints`: those of the training
    and test sets this run reads, as its record holds them (recorded.differs()); `declared`: what this run's states declare (recorded.declared()).
    A restart is this run's only where the folder's manifest names this launch (ownership.continues()): else the
    run starts afresh, in a folder that must be free."""
    manifest = ownership.read(args.output_dir)
    restarted = restarted and ownership.continues(manifest)
    if name == SHARDED:
        links.check(args.output_dir, fallback)
    if args.resume is None and restarted and path is None:  # restarted before its first checkpoint, or it is gone
        if saved(args.output_dir):  # the one before is there: never started afresh over it, unsaid
            missing(args.output_dir / name, manifest, "this run's restart finds ")
        return None, manifest["run"]
    if args.resume is None and not restarted:  # afresh, whatever the folder holds
        if manifest and manifest.get("record") and ownership.output(args.output_dir) and not saved(args.output_dir):
            return None, again(args, manifest, fingerprints)
        ownership.check_fresh(args.output_dir, manifest)
        return None, None
    own = args.output_dir / name
    if not path.exists():
        missing(path, manifest if path == own else None)
    try:
        state = load(path)
    except (Unusable, Planted) as problem:
        hint = fallback(args.output_dir, path.resolve()) if path == own else ""
        if isinstance(problem, Planted):  # nothing of it was run: say so, and what to resume from instead
            raise Refusal(f"error: {problem}; delete it or resume from another checkpoint{hint}") from None
        # the run's own file may go; a file --resume names elsewhere is the user's: never advise deleting it
        advice = ": delete it or use another" if path == own else ": resume from another checkpoint"
        raise Refusal(f"error: {problem}{hint or advice}") from None
    if name == WHOLE:
        check_whole(path, own, state)
    source = path.resolve().parent  # the run folder of a checkpoint.pt, or of a sharded epoch-N folder
    theirs = manifest if source == args.output_dir.resolve() else ownership.read(source)
    stamp = state.get("run") if isinstance(state.get("run"), dict) else {}  # recorded.Stamp's; none before it
    if theirs and stamp.get("id", theirs["run"]) != theirs["run"]:  # another run's, copied in
        own = source == args.output_dir.resolve()  # the run's own file may go; a user's is never named for it
        advice = f"delete it{fallback(args.output_dir, path.resolve())}" if own else "resume from another checkpoint"
        raise Refusal(f"error: {path} is a checkpoint of run {stamp['id']}, not of {ownership.whose(theirs)}: {advice}")
    stamped = stamp.get("record", stamp if "flags" in stamp else None)  # an older version's: the record alone
    stamped = stamped if isinstance(stamped, dict) else None  # what defines it, by its own word
    if not (run := stamped or (theirs or {}).get("record")):  # a checkpoint.pt copied away alone
        raise Refusal(
            f"error: {path} has no {ownership.MANIFEST} beside it to say what run it is (its options, "
            "its data): resume it in its run's folder, or copy that folder whole"
        )
    # what the run was given first (its options, task and data: the cause), then what its checkpoint holds
    if problem := recorded.differs(run, args, fingerprints) or recorded.check_values(state, declared):
        raise Refusal(f"error: {path} {problem}")
    if problem := mismatch(run, state, args, fingerprints):  # its epoch, against --epochs
        raise Refusal(f"error: {path} {problem}")
    return state | {"run_record": run}, ownership.check_resume(args.output_dir, manifest, path, stamp.get("id"))


def missing(path, manifest, who=""):
    """A checkpoint to resume from that is not there, in one line, with what the folder holds instead: the other kind,
    the complete one before (checkpoint-previous.pt, stage 05's folder before), or that the run saved none.
    `manifest`: that of the folder, where `path` is the run's own checkpoint there."""
    folder, name = path.parent, path.name
    other = folder / (WHOLE if name == SHARDED else SHARDED)
    fix = f"resume it with --resume {other}" if other.name == WHOLE else "resume it there, or export with --save-model"
    held = f" (it holds {other.name}, of {'stages 01-04' if other.name == WHOLE else 'stage 05'}): {fix}"
    held = held if other.exists() else ""
    if manifest and not saved(folder):
        held = f": {ownership.whose(manifest)} saved none; the same command without --resume starts it again"
    elif path.is_symlink():  # stage 05's link, to a folder deleted or moved: the one before may be whole
        held = f" ({path} names {os.readlink(path)}, which is gone){fallback(folder, path.resolve())}"
    elif manifest:
        held = fallback(folder, path) or held
    raise Refusal(f"error: {who}no {name} in {folder} to resume from{held}")


def load(path):
    """A checkpoint's run state: checkpoint.pt, or a sharded folder's state.pt with its shards checked and
    "folder" added; Unusable if it is damaged or no training checkpoint, Planted if it would run code."""
    folder = path.resolve() if path.is_dir() else None
    file = folder / "state.pt" if folder else path
    if file.exists() and not file.is_file():  # a FIFO blocks the read for ever, where a signal is only noted
        raise Unusable(f"{file} is not a regular file (a FIFO, a socket or a device)")
    try:
        torch_file(file)  # its headers against what it declares, before torch allocates what it declares
    except Refused as problem:
        if safeload.calls(file):  # no zip: a plain pickle naming a callable
            raise Planted(
                f"{file} is not a checkpoint this repository wrote (a pickle that names a callable): it may be planted"
            ) from None
        reason = str(problem).removeprefix(str(file)).lstrip(": ")
        raise Unusable(f"{file} is not a checkpoint this code wrote, or is damaged: {reason}") from None
    try:
        state = read(path)
    except pickle.UnpicklingError as err:
        if "global" not in str(err).lower() and not safeload.calls(file):  # a pickle that calls nothing: a damaged file
            raise Unusable(f"{path} is not a checkpoint this code wrote, or is damaged (UnpicklingError)") from None
        raise Planted(
            f"{file} is not a checkpoint this repository wrote (torch.load with weights_only=True "
            "refuses it): it may be planted"
        ) from None
    except Exception as err:  # a truncated file
        raise Unusable(f"{path} is not a checkpoint this code wrote, or is damaged ({type(err).__name__})") from None
    if not (isinstance(state, dict) and "epoch" in state and ("model" in state or folder)):
        shards = file.parent / ".metadata"  # stage 05's state.pt lies beside its shards' index
        if isinstance(state, dict) and "epoch" in state and shards.is_file():
            raise Unusable(f"{path} is one file of a sharded checkpoint: give its folder, {file.parent}")
        raise Unusable(
            f"{path} is not a training checkpoint (a --save-model file holds weights only): give "
            "<output-dir>/checkpoint.pt (stage 05: the folder <output-dir>/checkpoint)"
        )
    if folder and (problem := damage(folder)):
        raise Unusable(f"{path} is damaged: {problem}")
    return state | {"folder": folder, "shards": tensors(folder) if folder else None}  # checked as 01-04's are


def fallback(output_dir, damaged):
    """The complete checkpoint before the damaged latest one in output_dir, as a hint: '' if there is none."""
    whole = damaged.is_file() or damaged.name == WHOLE  # checkpoint.pt damaged, or gone
    candidates = [output_dir / PREVIOUS] if whole else [f for f in epochs(output_dir) if f != damaged]
    for path in candidates:
        try:
            state = load(path)
        except (Unusable, Planted, FileNotFoundError):
            continue
        return f": the checkpoint of epoch {state['epoch']} is complete: resume from it with --resume {path}"
    return ""
