"""Guard rail: a run owns what it wrote, and nothing else.

The invariant: a run replaces, rotates or deletes only what the manifest of its folder lists, and only in a
folder whose manifest names it. At its fresh start a run takes an id and writes <output-dir>/run-manifest.json:
the id, the launch that runs it (a Slurm job and step, or a torchrun run and its agent) and what it writes there
(checkpoint.pt, checkpoint-previous.pt, metrics.csv, model.pt once --save-model asks for it; stage 05: its links
checkpoint and checkpoint-previous and each epoch-N folder, listed before it is written). Before any rank writes,
rank 0 decides whose folder it is (claim()):
  - a fresh run: a folder holding any entry named as a run names its output (a checkpoint, metrics.csv,
    model.pt, an epoch-N folder, a writer's temporary file, a dangling link) is refused; a manifest and
    tracebacks alone are what a run that saved nothing left: nothing to lose, the folder is taken over;
  - a restart (a Slurm requeue, a torchrun restart) is this run only where the manifest names this launch;
    else it is a fresh run: the restart of an attempt that was refused is refused again;
  - --resume PATH continues the run whose folder holds PATH: the output folder must be that run's or free.
A user's own files (every other name) are never opened, replaced or deleted; stage 05 rotates its folders by
its links, never by their names; lock.sweep() deletes only the temporary files of this run's writers. Run folders
do not nest: a folder inside another run's is refused, and a new run's folder holding one (two levels down).
tests/test_ownership.py proves each of these.
"""

import itertools
import json
import os
import re
import socket
import stat
import time
import uuid

from common.checkpoint import atomic
from common.guards.ending import Refusal
from common.guards.lock import TEMPORARY, sweep

MANIFEST = "run-manifest.json"
WRITES = {  # what a run writes in its folder, by the kind of checkpoint it keeps
    False: ["checkpoint.pt", "checkpoint-previous.pt", "metrics.csv", "model.pt"],
    True: ["checkpoint", "checkpoint-previous", "metrics.csv", "model.pt"],
}
NAMED = {*WRITES[False], *WRITES[True], "checkpoint.tmp", MANIFEST}
EPOCH = re.compile(r"epoch-\d+(-step-\d+)?")  # stage 05's folders
TRACEBACK = re.compile(r"traceback-rank\d+\.txt")  # a failed run's (described.keep())
ADVICE = "choose another --output-dir, or move it away"


def launch(env=os.environ):
    """Who started this process: the same after a requeue and after a torchrun restart, else different. None
    without Slurm or torchrun. A torchrun on one node names its agent, the workers' parent: its run id is
    "none" unless given."""
    if env.get("SLURM_JOB_ID"):
        task = f"_{env['SLURM_ARRAY_TASK_ID']}" if "SLURM_ARRAY_TASK_ID" in env else ""
        return f"Slurm job {env['SLURM_JOB_ID']}{task}, step {env.get('SLURM_STEP_ID', 'batch')}"
    if env.get("TORCHELASTIC_RUN_ID"):
        one_node = env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE")
        agent = f", agent pid {os.getppid()} on {socket.gethostname()}" if one_node else ""
        return f"torchrun {env['TORCHELASTIC_RUN_ID']}{agent}"
    return None


def named(name):
    """Is `name` one a run gives to what it writes?"""
    return name in NAMED or any(kind.fullmatch(name) for kind in (EPOCH, TEMPORARY, TRACEBACK))


def entries(folder):
    try:
        return sorted(os.listdir(folder))
    except OSError as err:
        raise Refusal(f"error: cannot list --output-dir {folder}: {err.strerror}: {ADVICE}") from None


def read(folder):
    """The manifest of `folder`, or None; one line where it holds one this code did not write (a link, a FIFO,
    anything but the JSON it writes), which is never opened further."""
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return None
    try:
        fd = os.open(
            path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        )  # a link or a FIFO neither followed nor waited on
        with os.fdopen(fd, "rb") as f:
            manifest = json.loads(f.read(2**20)) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and well_formed(manifest):
        return manifest
    raise Refusal(f"error: {path} is not a manifest this repository wrote: {ADVICE}")


def well_formed(manifest):
    """Each field the guard rails read is of the type claim() writes: an edited one is no AttributeError later."""
    writes, record = manifest.get("writes"), manifest.get("record", {})
    return (
        isinstance(manifest.get("run"), str)
        and isinstance(writes, list)
        and all(isinstance(n, str) for n in writes)
        and isinstance(manifest.get("launch"), str | None)
        and isinstance(record, dict)
        and isinstance(record.get("flags", {}), dict)
        and isinstance(record.get("data", ""), str)
        and isinstance(record.get("test", ""), str)
        and isinstance(record.get("parameters", 0), int)
        and isinstance(record.get("world", 1), int)
        and isinstance(record.get("mesh") or [], list)
        and isinstance(record.get("stage", ""), str)
    )


def continues(manifest, env=os.environ):
    """Is this restart (a requeue, a torchrun restart) the launch that wrote `manifest`?"""
    return manifest is not None and launch(env) is not None and manifest.get("launch") == launch(env)


def output(folder):
    """What in `folder` is a run's output, which a fresh run must not replace: the names a run writes, but the
    manifest and the tracebacks that a run that saved nothing leaves, and the temporary files of writers killed
    mid-write (with the folder locked, no live writer's: never whole, and swept by claim())."""
    leftovers = (TRACEBACK, TEMPORARY)
    return [n for n in entries(folder) if named(n) and n != MANIFEST and not any(k.fullmatch(n) for k in leftovers)]


def whose(manifest):
    """`run <id>`, and the launch that wrote it where one did (a Slurm job, a torchrun)."""
    return f"run {manifest['run']}" + (f" ({manifest['launch']})" if manifest.get("launch") else "")


def check_fresh(folder, manifest):
    """A fresh run: the folder holds nothing a run writes, whichever run wrote it (or none, with its names), but
    what a run that saved nothing leaves (its manifest, its tracebacks): nothing to lose, and taken over."""
    names = entries(folder)
    for name in ("checkpoint.pt", "checkpoint"):
        if name in names:  # whole or sharded, of any stage: a fresh run would overwrite its metrics.csv
            raise Refusal(
                f"error: {folder / name} holds the checkpoint of an earlier run: add --resume to continue "
                "it (in the stage that wrote it), or choose another --output-dir"
            )
    found = output(folder)
    if manifest and found:
        raise Refusal(
            f"error: {folder} holds the output of {whose(manifest)}: add --resume to continue it, or {ADVICE}"
        )
    if found:
        raise Refusal(f"error: {folder / found[0]} is not this run's, and a run writes that name: {ADVICE}")


def check_resume(folder, manifest, path, named=None):
    """--resume PATH, or a restart: the folder is that of the run PATH's folder holds, or free. Returns the
    run's id: its manifest's; where none names it, the one the checkpoint names (`named`, its stamp: a new id
    would make the checkpoint another run's at the next resume, before this one saved its own), else None (a
    checkpoint of an older version)."""
    source = path.resolve().parent
    theirs = manifest if source == folder.resolve() else read(source)
    named = named if isinstance(named, str) else None
    if theirs is None and source == folder.resolve():
        return named  # the folder's own checkpoint, no manifest beside it (copied alone, or it was lost): adopted
    run = theirs["run"] if theirs else named
    if manifest is None or not output(folder):  # free, or what a run that saved nothing left
        check_fresh(folder, None)
        return run
    if manifest["run"] != run:
        raise Refusal(
            f"error: {folder} holds the output of {whose(manifest)}, "
            f"and {path} is of {f'run {run}' if run else 'no run it names'}: resume into {source}, "
            "or into an empty --output-dir"
        )
    if stray := [n for n in entries(folder) if EPOCH.fullmatch(n) and n not in manifest["writes"]]:
        raise Refusal(f"error: {folder / stray[0]} is not this run's (its manifest does not list it): {ADVICE}")
    return run


def claim(folder, run, sharded, record, export=False, env=os.environ):
    """Rank 0, once the folder is this run's: (re)write its manifest for run `run` (a new id if None), this
    launch and `record` (what defines the run: resume.mismatch()), then delete the temporary files this run's
    writers left. model.pt is listed where the run will `export` one (--save-model): a model.pt in its folder
    that it did not list is someone else's, which the export would replace."""
    if inside := next((p for p in folder.resolve().parents if os.path.lexists(p / MANIFEST)), None):
        raise Refusal(
            f"error: --output-dir {folder} lies inside {inside}, the folder of another run, which may "
            "delete its folders: choose a folder outside it"
        )
    manifest = read(folder)
    below = itertools.chain(folder.glob(f"*/{MANIFEST}"), folder.glob(f"*/*/{MANIFEST}"))  # runs/<stage>/<id>
    if (manifest is None or manifest["run"] != run) and (held := next(below, None)):
        raise Refusal(
            f"error: --output-dir {folder} holds {held.parent}, the folder of another run, which could "
            "then no longer resume: choose a folder beside it"
        )
    if manifest is None or manifest["run"] != run:  # a fresh run, a resume into a new folder, or an adopted one
        # what the folder holds is this run's where no manifest said whose: adopted (its checkpoint's run, or a new one)
        adopted = run is None or manifest is None
        kept = [n for n in entries(folder) if named(n) and not TEMPORARY.fullmatch(n)] if adopted else []
        manifest = {"run": run or uuid.uuid4().hex, "since": time.ctime(), "writes": kept}
    if export and "model.pt" not in manifest["writes"] and os.path.lexists(folder / "model.pt"):
        raise Refusal(
            f"error: {folder / 'model.pt'} is not this run's (it has not exported one), and "
            f"--save-model would replace it: leave out --save-model, or move it away"
        )
    listed = [n for n in WRITES[sharded] if n != "model.pt" or export]
    writes = manifest["writes"] + [n for n in listed if n not in manifest["writes"]]
    write(folder, manifest | {"launch": launch(env), "writes": writes, "record": record})
    sweep(folder)


def writes(folder, name):
    """Rank 0, before it writes `name` (a stage 05 folder): the manifest lists it, and no longer lists the
    folders the lesson has rotated out."""
    manifest = read(folder)
    listed = [n for n in manifest["writes"] if not EPOCH.fullmatch(n) or os.path.lexists(folder / n)]
    write(folder, manifest | {"writes": listed + ([name] if name not in listed else [])})


def write(folder, manifest):
    with atomic(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
