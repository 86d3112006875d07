"""A run owns what it wrote, and nothing else (common/guards/ownership.py): whatever its files are called and
however the run was started, a folder holding another run's output is refused in one line, and a user's own
files are never touched."""

import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import (
    INJECT,
    REPO,
    S01,
    S03,
    S05,
    checkpoint,
    clean_env,
    metrics,
    one_error,
    python,
    run,
    stage_args,
    torchrun_cmd,
    trained,
)

from common import sharded
from common.guards import failure, identity, lock, ownership, preflight, rails, resume


def small(script, data_dir, out, *extra, **env):
    return python(script, *stage_args(data_dir, out, "--limit", 64, *extra), **env)


def outside_lock(folder):
    """contents() but the .lock, which every run takes first."""
    return outside_lock_of(contents(folder))


def outside_lock_of(found):
    return {path: value for path, value in found.items() if path.name != ".lock"}


def contents(folder):
    """Every file under `folder` and its bytes, links as what they name: what a refused run must leave alone."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[path.relative_to(folder)] = os.readlink(path)
        elif path.is_file():
            found[path.relative_to(folder)] = path.read_bytes()
        else:
            found[path.relative_to(folder)] = "folder"
    return found


def test_a_refused_run_touches_no_output_of_another_run_nor_a_users_file(tiny_data, tmp_path):
    """Another run's checkpoint-previous.pt, metrics.csv and model.pt without its checkpoint.pt were overwritten;
    a user's *.tmp<N>* files were deleted before the run was refused."""
    for name in ("checkpoint-previous.pt", "metrics.csv", "model.pt", "notes.tmp1", "data.tmp5.csv"):
        (tmp_path / name).write_bytes(f"theirs: {name}".encode())
    before = contents(tmp_path)
    one_error(small(S01, tiny_data, tmp_path, "--epochs", 1), "is not this run's, and a run writes that name")
    assert outside_lock(tmp_path) == before


def test_the_lock_never_follows_a_link_nor_truncates_a_file_it_did_not_write(tmp_path):
    """A .lock linked to a file of the user's truncated it; one of another program was truncated too."""
    target = tmp_path / "precious.txt"
    target.write_text("the user's")
    (tmp_path / ".lock").symlink_to(target)
    with pytest.raises(SystemExit, match=r"^error: .*\.lock is a link: the lock is never taken through one"):
        lock.claim(tmp_path, env={})
    assert target.read_text() == "the user's" and (tmp_path / ".lock").is_symlink()
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").write_text("another program's lock")
    with pytest.raises(SystemExit, match="is not a lock this repository wrote"):
        lock.claim(tmp_path, env={})
    assert (tmp_path / ".lock").read_text() == "another program's lock"
    (tmp_path / ".lock").unlink()
    os.mkfifo(tmp_path / ".lock")  # opened for reading and writing, a FIFO would not block, but is no lock
    with pytest.raises(SystemExit, match="is not a regular file"):
        lock.claim(tmp_path, env={})


def test_the_sweep_deletes_only_what_this_runs_writers_left(tmp_path):
    """*.tmp[0-9]* took a user's notes.tmp1 and data.tmp5.csv, and a folder by that name raised."""
    for name in ("metrics.csv.tmp12", "checkpoint.pt.tmp7", "notes.tmp1", "data.tmp5.csv", "metrics.csv.tmp1x"):
        (tmp_path / name).write_text("x")
    (tmp_path / "model.pt.tmp3").mkdir()
    lock.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "data.tmp5.csv", "metrics.csv.tmp1x", "model.pt.tmp3", "notes.tmp1"
    ]  # fmt: skip


def sharded_states():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer}


def test_stage05_rotates_only_the_folders_its_links_named(tmp_path):
    """Kept "the two newest" epoch-* folders by name: stale epoch-8 and epoch-9 made it delete what it had just
    written, and a user's epoch-0 went too. The lesson deletes only what its own links named."""
    for name in ("epoch-8", "epoch-9", "epoch-0"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kept.txt").write_text(name)
    states = sharded_states()
    for epoch in (1, 2, 3):
        sharded.save(tmp_path, epoch, states)
    assert (
        os.readlink(tmp_path / "checkpoint") == "epoch-3" and os.readlink(tmp_path / "checkpoint-previous") == "epoch-2"
    )
    assert sorted(p.name for p in tmp_path.glob("epoch-*")) == ["epoch-0", "epoch-2", "epoch-3", "epoch-8", "epoch-9"]
    assert all((tmp_path / name / "kept.txt").read_text() == name for name in ("epoch-8", "epoch-9", "epoch-0"))
    sharded.save(tmp_path, 3, states, step=5)  # mid-epoch, then the epoch again (a rewound run)
    sharded.save(tmp_path, 3, states)
    assert os.readlink(tmp_path / "checkpoint") == "epoch-3"
    assert os.readlink(tmp_path / "checkpoint-previous") == "epoch-3-step-5"
    assert (tmp_path / "epoch-3" / "state.pt").is_file() and not (tmp_path / "epoch-2").exists()


@pytest.mark.slow
def test_a_restart_of_another_launch_is_refused_and_its_own_resumes(tiny_data, tmp_path):
    """A restart (here Slurm's: SLURM_RESTART_COUNT=1) was taken for a resume of whatever run the folder held;
    only the launch that wrote the folder continues it."""
    assert small(S01, tiny_data, tmp_path, "--epochs", 1, SLURM_JOB_ID=41).returncode == 0
    before = (tmp_path / "metrics.csv").read_bytes()
    for job in (42, None):  # another job; none at all (a torchrun restart count set by hand)
        env = {"SLURM_JOB_ID": job} if job else {"TORCHELASTIC_RESTART_COUNT": 1}
        out = small(S01, tiny_data, tmp_path, "--epochs", 2, SLURM_RESTART_COUNT=1, **env)
        one_error(out, "holds the checkpoint of an earlier run")
        assert (tmp_path / "metrics.csv").read_bytes() == before
    out = small(S01, tiny_data, tmp_path, "--epochs", 2, SLURM_JOB_ID=41, SLURM_RESTART_COUNT=1)
    assert out.returncode == 0 and "resumed after epoch 1" in out.stdout, out.stderr
    assert len(metrics(tmp_path)) == 2


@pytest.mark.slow
def test_a_restart_whose_checkpoint_is_gone_names_the_one_before_and_starts_nothing_over_it(tiny_data, tmp_path):
    """checkpoint.pt deleted from a run's folder (by hand, a scratch purge), checkpoint-previous.pt still there: a
    requeue took itself for one before the first save and trained again from epoch 1, over the complete checkpoint
    and the rows. A bare --resume said there was nothing to resume from. Both name the one before and its command."""
    assert small(S01, tiny_data, tmp_path, "--epochs", 2, SLURM_JOB_ID=41).returncode == 0
    (tmp_path / "checkpoint.pt").unlink()
    before = (tmp_path / "metrics.csv").read_bytes(), (tmp_path / "checkpoint-previous.pt").read_bytes()
    hint = f"the checkpoint of epoch 1 is complete: resume from it with --resume {tmp_path / 'checkpoint-previous.pt'}"
    out = small(S01, tiny_data, tmp_path, "--epochs", 3, SLURM_JOB_ID=41, SLURM_RESTART_COUNT=1)
    one_error(out, f"this run's restart finds no checkpoint.pt in {tmp_path} to resume from", hint)
    one_error(small(S01, tiny_data, tmp_path, "--epochs", 3, "--resume", SLURM_JOB_ID=41), "no checkpoint.pt in", hint)
    assert ((tmp_path / "metrics.csv").read_bytes(), (tmp_path / "checkpoint-previous.pt").read_bytes()) == before


@pytest.mark.slow
def test_a_torchrun_restart_of_a_refused_run_is_refused_again(uninterrupted, tiny_data, tmp_path):
    """torchrun --max-restarts (as the job scripts use): the first attempt is refused (the folder holds an
    earlier run), and its restart took itself for a resume and overwrote that run."""
    trained(uninterrupted, tmp_path, S01, "--limit", 64, "--epochs", 1)  # small()'s run, shared
    before = contents(tmp_path)
    cmd = torchrun_cmd(1, S03, *stage_args(tiny_data, tmp_path, "--limit", 64, "--epochs", 2), restarts=1)
    out = run(cmd, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), timeout=180)
    assert out.returncode != 0 and out.stderr.count("holds the checkpoint of an earlier run") == 2, out.stderr
    assert outside_lock(tmp_path) == outside_lock_of(before)


@pytest.mark.slow
def test_a_resume_into_another_runs_folder_is_refused(uninterrupted, tiny_data, tmp_path):
    """--resume A --output-dir B overwrote the run in B; into an empty folder it continues A's run there, and
    that folder is then A's run's: a requeue of it resumes from its own newest checkpoint."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    trained(uninterrupted, a, S01, "--limit", 64, "--epochs", 1)  # small()'s run, shared; b is a run of its own
    assert small(S01, tiny_data, b, "--epochs", 1).returncode == 0
    before = contents(b)
    one_error(small(S01, tiny_data, b, "--epochs", 2, "--resume", a / "checkpoint.pt"), f"{b} holds the output of run")
    assert outside_lock(b) == outside_lock_of(before)
    out = small(S01, tiny_data, c, "--epochs", 2, "--resume", a / "checkpoint.pt", SLURM_JOB_ID=43)
    assert out.returncode == 0 and "resumed after epoch 1" in out.stdout, out.stderr
    assert (
        json.loads((c / ownership.MANIFEST).read_text())["run"]
        == json.loads((a / ownership.MANIFEST).read_text())["run"]
    )
    requeued = small(S01, tiny_data, c, "--epochs", 3, "--resume", a / "checkpoint.pt", SLURM_JOB_ID=43,
                     SLURM_RESTART_COUNT=1)  # fmt: skip
    assert requeued.returncode == 0 and "resumed after epoch 2" in requeued.stdout, requeued.stderr


@pytest.mark.slow
def test_a_checkpoint_copied_alone_or_without_its_manifest_stays_its_runs_across_resumes(
    uninterrupted, tiny_data, tmp_path
):
    """A checkpoint copied alone into a new folder, or whose folder lost its manifest, resumed as a new run: after one
    failure before its next save, every resume called the folder's only checkpoint another run's and said to delete
    it. The folder takes the run the checkpoint names."""
    a, b = tmp_path / "a", tmp_path / "b"
    trained(uninterrupted, a, S01, "--limit", 64, "--epochs", 1)  # small()'s run, shared
    b.mkdir()
    shutil.copy(a / "checkpoint.pt", b)  # copied alone
    (a / ownership.MANIFEST).unlink()  # its manifest lost
    ran = checkpoint(a)["run"]["id"]
    for folder in (a, b):
        crashed = small(S01, tiny_data, folder, "--epochs", 2, "--resume", PYTHONPATH=f"{INJECT}:{REPO}",
                        FAULT_RANK=0, FAULT_STEP=1)  # fmt: skip
        assert crashed.returncode == 1 and "injected fault" in crashed.stderr, crashed.stderr[-2000:]
        assert json.loads((folder / ownership.MANIFEST).read_text())["run"] == ran
        again = small(S01, tiny_data, folder, "--epochs", 2, "--resume")
        assert again.returncode == 0 and "resumed after epoch 1" in again.stdout, again.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["checkpoint-previous.pt", "metrics.csv", "model.pt", "epoch-3", "checkpoint"])
def test_any_output_of_another_run_is_refused_by_a_fresh_run(tiny_data, tmp_path, name):
    """Each name a run writes, alone: a file (a folder for epoch-3, a dangling link for checkpoint) a fresh
    run would have replaced or deleted."""
    if name == "checkpoint":
        (tmp_path / name).symlink_to("epoch-7")  # names nothing: exists() is False
    elif name == "epoch-3":
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("the user's")
    else:
        (tmp_path / name).write_text("another run's")
    before = contents(tmp_path)
    one_error(small(S05 if name.startswith(("epoch", "checkpoint")) else S01, tiny_data, tmp_path, "--epochs", 1), name)
    assert outside_lock(tmp_path) == before


@pytest.mark.slow
def test_stage05_refuses_a_folder_with_stale_or_foreign_epoch_folders(uninterrupted, tiny_data, tmp_path):
    """A fresh stage 05 run beside stale epoch-8 and epoch-9 folders deleted the checkpoint it had just written
    (a requeue then restarted at epoch 1 and overwrote metrics.csv); a resumed one refuses an epoch folder its
    manifest does not list, which its rotation could otherwise take."""
    for name in ("epoch-8", "epoch-9"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_text(name)
    before = contents(tmp_path)
    one_error(small(S05, tiny_data, tmp_path, "--epochs", 2), "epoch-8 is not this run's")
    assert outside_lock(tmp_path) == before
    own = tmp_path / "own"
    trained(uninterrupted, own, S05, "--limit", 64, "--epochs", 2)  # small()'s run, shared
    (own / "epoch-5").mkdir()
    one_error(small(S05, tiny_data, own, "--epochs", 3, "--resume"), f"{own / 'epoch-5'} is not this run's")
    (own / "epoch-5").rmdir()
    out = small(S05, tiny_data, own, "--epochs", 3, "--resume")
    assert out.returncode == 0 and "resumed after epoch 2" in out.stdout, out.stderr
    assert sorted(p.name for p in own.glob("epoch-*")) == ["epoch-2", "epoch-3"]


@pytest.mark.slow
def test_hostile_folders_are_refused_in_one_line(uninterrupted, tiny_data, tmp_path):
    """A folder inside another run's (whose rotation may delete it) or a new one holding one (which blocked its
    resume), a manifest that is a link or not JSON, a .lock that is a folder, an --output-dir that is a file: one
    line each, nothing of the user's touched."""
    other = tmp_path / "runs" / "other"
    trained(uninterrupted, other, S05, "--limit", 64, "--epochs", 2)  # small()'s run, shared
    one_error(small(S01, tiny_data, other / "epoch-1" / "nested", "--epochs", 1), "lies inside", str(other))
    for above in (other.parent, tmp_path):  # a new run above it would block its resume: refused, not the resume
        one_error(small(S01, tiny_data, above, "--epochs", 1), f"holds {other}, the folder of another run")
    assert small(S05, tiny_data, other, "--epochs", 3, "--resume").returncode == 0
    cases = {
        "link": lambda f: (f / ownership.MANIFEST).symlink_to(other / ownership.MANIFEST),
        "garbage": lambda f: (f / ownership.MANIFEST).write_text("{not json"),
        "lock folder": lambda f: (f / ".lock").mkdir(),
    }
    for case, make in cases.items():
        folder = tmp_path / case.replace(" ", "-")
        folder.mkdir()
        make(folder)
        before = contents(folder)
        out = small(S01, tiny_data, folder, "--epochs", 1)
        one_error(out, str(folder))
        assert (contents(folder) if case == "lock folder" else outside_lock(folder)) == before, case
    (tmp_path / "a-file").write_text("the user's")
    one_error(small(S01, tiny_data, tmp_path / "a-file", "--epochs", 1), "a-file")
    assert (tmp_path / "a-file").read_text() == "the user's"


@pytest.mark.parametrize(
    "field, value",
    [("run", 5), ("writes", [1]), ("launch", ["job"]), ("record", 5), ("record", {"flags": [1, 2]}),
     ("record", {"data": 7}), ("record", {"parameters": "many"})],
)  # fmt: skip
def test_a_manifest_edited_into_another_shape_is_named_not_a_guard_rails_error(field, value, tmp_path):
    """`"record": 5` in a finished run's manifest ended a --resume in an AttributeError at a guard rail's line."""
    manifest = {"run": "a" * 32, "since": "then", "writes": ["metrics.csv"], "launch": None, "record": {}}
    (tmp_path / ownership.MANIFEST).write_text(json.dumps(manifest))
    assert ownership.read(tmp_path) == manifest
    (tmp_path / ownership.MANIFEST).write_text(json.dumps(manifest | {field: value}))
    with pytest.raises(SystemExit, match=f"^error: {tmp_path / ownership.MANIFEST} is not a manifest this repository"):
        ownership.read(tmp_path)


def test_a_failure_keeps_its_traceback_only_where_the_run_owns_the_folder(tmp_path):
    """A task that fails before the folder is the run's: its traceback was written through a link named
    traceback-rank0.txt (a user's file truncated) and into another run's folder. It is switched in whole where the
    folder holds no run's output (a link there replaced, never followed), and nowhere in another run's folder."""
    victim, mine, theirs = tmp_path / "precious.txt", tmp_path / "mine", tmp_path / "theirs"
    victim.write_text("the user's")
    mine.mkdir()
    (mine / "traceback-rank0.txt").symlink_to(victim)
    theirs.mkdir()
    (theirs / "checkpoint.pt").write_text("another run's")
    guard = rails.Guard()
    guard.lock = "taken"  # the run holds the folder's lock; resume() has not made it the run's
    for folder, kept in ((mine, True), (theirs, False)):
        guard.args = SimpleNamespace(task=None, output_dir=folder)
        said = failure.fallback(RuntimeError("boom"), guard)
        assert said.startswith("error: RuntimeError: boom") and ("traceback is in" in said) == kept, said
    assert victim.read_text() == "the user's" and "RuntimeError: boom" in (mine / "traceback-rank0.txt").read_text()
    assert sorted(os.listdir(theirs)) == ["checkpoint.pt"]


def test_a_folder_a_run_left_before_its_first_checkpoint_is_taken_over(tmp_path):
    """A run that diverged (or was killed) before its first checkpoint left its manifest and a traceback: a fresh
    run there was refused (`holds the output of run ... (None): add --resume`), and --resume found no checkpoint.
    With nothing to lose (a temporary file of a writer killed mid-write is never whole) the folder is taken over;
    another run's output still refuses it, named without `(None)`."""
    manifest = {"run": "dead", "writes": [*ownership.WRITES[False]], "launch": None}
    ownership.write(tmp_path, manifest)
    (tmp_path / "traceback-rank0.txt").write_text("Traceback ...")
    (tmp_path / "checkpoint.pt.tmp4242").write_bytes(b"PK")  # its writer killed mid-write: never whole, swept
    ownership.check_fresh(tmp_path, ownership.read(tmp_path))
    (tmp_path / "epoch-1").mkdir()  # stage 05's first save killed half-way: no link names it, nothing to resume
    assert not resume.saved(tmp_path)
    (tmp_path / "checkpoint").symlink_to("epoch-1")
    assert resume.saved(tmp_path)
    (tmp_path / "checkpoint").unlink()
    (tmp_path / "epoch-1").rmdir()
    other = tmp_path / "other"  # --resume other/checkpoint.pt into it: that run continues here
    other.mkdir()
    ownership.write(other, {"run": "other", "writes": [*ownership.WRITES[False]], "launch": None})
    (other / "checkpoint.pt").write_text("a checkpoint")
    assert ownership.check_resume(tmp_path, ownership.read(tmp_path), other / "checkpoint.pt") == "other"
    (tmp_path / "metrics.csv").write_text("epoch\n1\n")
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path} holds the output of run dead: add --resume"):
        ownership.check_fresh(tmp_path, ownership.read(tmp_path))


@pytest.mark.slow
def test_a_run_killed_in_its_first_checkpoint_write_starts_again(uninterrupted, tiny_data, tmp_path):
    """Killed while writing its first checkpoint, a run leaves metrics.csv with epoch 1's row and a temporary
    checkpoint.pt.tmp<pid>: the same command was refused (`holds the output of run ...: add --resume`), and
    --resume found no checkpoint: only deleting files by hand got out. Now the same command starts that run again
    (its id, its temporary file swept); --resume says so; other options are refused (its rows are not theirs)."""
    trained(uninterrupted, tmp_path, S01, "--epochs", 1)  # the run of one epoch, shared
    (tmp_path / "checkpoint.pt").rename(tmp_path / "checkpoint.pt.tmp4242")  # what the killed write left
    run = ownership.read(tmp_path)["run"]
    one_error(python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--resume")),
              f"run {run} saved none; the same command without --resume starts it again")  # fmt: skip
    one_error(python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--lr", 0.5)),
              f"holds the metrics of run {run}, which saved no checkpoint", "--lr 1.0 (now 0.5)")  # fmt: skip
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1))
    assert out.returncode == 0 and f"run {run} saved no checkpoint: it starts again from epoch 1" in out.stdout
    assert ownership.read(tmp_path)["run"] == run and len(metrics(tmp_path)) == 1 and checkpoint(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_save_model_replaces_only_a_model_the_run_exported(tmp_path):
    """A model.pt that a run without --save-model never wrote (the user's own, put in the run's folder) was
    replaced by the export of a resume with --save-model. The manifest lists model.pt once the run exports."""
    ownership.claim(tmp_path, None, False, {}, export=False, env={})
    run = ownership.read(tmp_path)["run"]
    assert "model.pt" not in ownership.read(tmp_path)["writes"]
    (tmp_path / "model.pt").write_text("the user's")
    with pytest.raises(SystemExit, match=r"model\.pt is not this run's .*--save-model would replace it"):
        ownership.claim(tmp_path, run, False, {}, export=True, env={})
    ownership.claim(tmp_path, run, False, {}, export=False, env={})  # a resume without --save-model
    (tmp_path / "model.pt").unlink()
    ownership.claim(tmp_path, run, False, {}, export=True, env={})
    assert "model.pt" in ownership.read(tmp_path)["writes"]
    (tmp_path / "model.pt").write_text("exported")
    ownership.claim(tmp_path, run, False, {}, export=True, env={})  # its own export: replaced by the next


MOVES = """import os
from pathlib import Path

import torch.nn.functional as F

from common.tasks.images import *  # noqa: F403


def loss(output, target):  # in epoch 2, the folder is renamed and a new one made at its path (a second run's)
    out = Path(os.environ["RUN_FOLDER"])
    if (out / "checkpoint.pt").exists() and not out.with_name("moved").exists():
        out.rename(out.with_name("moved"))
        out.mkdir()
        (out / "theirs.txt").write_text("a second run's")
    return F.cross_entropy(output, target)
"""


@pytest.mark.slow  # the fast test of the guarantee: test_a_folder_replaced_or_its_lock_removed_is_named_before_a_save
def test_a_folder_moved_while_its_run_trains_stops_it_writing_nothing_at_the_old_path(tiny_data, tmp_path):
    """The run wrote by path: a folder renamed during epoch 2, a new one made at its path, received epoch 2's
    checkpoint and metrics (the new folder's manifest naming another run). The run stops at its next save in one
    line; the new folder holds only what was put there, the moved one the run's epoch 1."""
    (tmp_path / "task.py").write_text(MOVES)
    out = tmp_path / "run"
    done = small(S01, tiny_data, out, "--epochs", 3, "--task", tmp_path / "task.py", RUN_FOLDER=out)
    one_error(done, "moved, renamed or replaced", str(out))
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert checkpoint(tmp_path / "moved")["epoch"] == 1 and len(metrics(tmp_path / "moved")) == 1


CHANGES_DIRECTORY = """import os

from common.tasks import images
from common.tasks.images import *  # noqa: F403

os.chdir(os.environ["AWAY"])  # as its module is read: before the stage parses the options


def datasets(args):  # after the lock is taken, before the manifest and the checkpoints are written
    os.chdir(os.path.join(os.environ["AWAY"], "further"))
    return images.datasets(args)
"""


@pytest.mark.slow  # the fast test of the guarantee: test_cli.py::test_the_paths_are_absolute_before_the_tasks_code_runs
def test_a_task_that_changes_directory_leaves_the_runs_folder_where_it_was_started(tiny_data, tmp_path):
    """A relative --output-dir was resolved again at every write: a task that changes directory had its
    checkpoints written under the new one, without manifest or lock. It is made absolute once, before any of the
    task's code runs: the lock, the manifest, the checkpoint and metrics all land in the folder the command named."""
    (tmp_path / "task.py").write_text(CHANGES_DIRECTORY)
    (tmp_path / "away" / "further").mkdir(parents=True)
    args = stage_args(tiny_data, "out", "--limit", 64, "--epochs", 1, "--task", tmp_path / "task.py")
    done = run([sys.executable, str(S01), *args], env=clean_env(AWAY=tmp_path / "away"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = {p.name for p in (tmp_path / "out").iterdir()}
    assert {".lock", "run-manifest.json", "checkpoint.pt", "metrics.csv"} <= written
    assert not [*(tmp_path / "away").rglob("out")]


def test_a_folder_replaced_or_its_lock_removed_is_named_before_a_save(tmp_path):
    """`rm .lock` let a second run take the folder while the first still wrote there; a folder replaced at its path
    received the first run's saves. Each is one line from the check every save makes first, and a folder left as
    it was passes it."""
    out = tmp_path / "run"
    fd = lock.claim(out)
    hold = identity.held(out, fd)
    assert identity.lost(hold) is None
    (out / ".lock").unlink()
    assert "this run's lock, was removed or replaced" in identity.lost(hold)
    lock.claim(out)  # a second run takes the folder
    assert "this run's lock, was removed or replaced" in identity.lost(hold)
    out.rename(tmp_path / "moved")
    assert f"--output-dir {out} is gone" in identity.lost(hold)
    out.mkdir()
    assert f"--output-dir {out} is another folder now" in identity.lost(hold)
    with pytest.raises(SystemExit, match="another folder now"):
        identity.check_held(hold)
    os.close(fd)


def test_a_folder_moved_inside_a_save_or_before_the_export_is_one_line_and_made_nowhere(tmp_path):
    """A folder renamed between the check before a save and its write: atomic() made it again at the old path and
    wrote there; the final --save-model export was checked against nothing. Now the write fails, naming the folder
    gone in one line (failure.explain()), and the export checks the folder first: nothing at the old path."""
    from common import checkpoint
    from common.options import export

    out = tmp_path / "run"
    guard = rails.Guard()
    guard.args = SimpleNamespace(task=None, output_dir=out)
    guard.lock = lock.claim(out)
    guard.hold = identity.held(out, guard.lock)
    out.rename(tmp_path / "moved")
    with pytest.raises(OSError) as raised:
        with checkpoint.atomic(out / "checkpoint.pt") as f:
            f.write(b"weights")
    assert not out.exists() and f"--output-dir {out} is gone" in failure.explain(raised.value, guard)
    (tmp_path / "moved").rename(out)  # back: the export passes the check and writes
    export.save_model(torch.nn.Linear(2, 2), out, guard)
    out.rename(tmp_path / "moved")
    out.mkdir()  # a new run's folder at the old path
    with pytest.raises(SystemExit, match="another folder now"):
        export.save_model(torch.nn.Linear(2, 2), out, guard)
    assert not (out / "model.pt").exists() and (tmp_path / "moved" / "model.pt").exists()
    os.close(guard.lock)


def test_a_folder_moved_just_before_stage05s_sharded_save_is_one_line_and_made_nowhere(tmp_path):
    """Stage 05's shards are written by DCP's FileSystemWriter, which made its folder with every parent (mkdir -p):
    a run folder renamed between the check before a save and the save was made again at its old path, and the
    shards, state.pt and the links were written there, exit 0. The writer makes the epoch's folder alone now: the
    save fails before anything is written, naming the folder gone in one line; nothing at the old path."""
    out = tmp_path / "run"
    guard = rails.Guard()
    guard.args = SimpleNamespace(task=None, output_dir=out)
    guard.lock = lock.claim(out)
    guard.hold = identity.held(out, guard.lock)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))
    sharded.save(out, 1, states)  # the folder where it was: saved
    out.rename(tmp_path / "moved")
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is no Exception
        sharded.save(out, 2, states)
    assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    assert failure.settle(raised.value, guard).startswith(f"error: --output-dir {out} is gone: ")
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == [".lock", "checkpoint", "epoch-1"]
    os.close(guard.lock)


def test_stage05s_shared_folder_check_makes_and_deletes_no_file(tmp_path):
    """Stage 05's check that every rank sees the output folder created and deleted `.shared` there: a user's file
    of that name was lost. It reads the lock rank 0 holds instead: the folder's files are as they were."""
    fd = lock.claim(tmp_path)
    (tmp_path / ".shared").write_text("a user's")
    before = contents(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        preflight.check_shared(tmp_path, fd)
    finally:
        dist.destroy_process_group()
        os.close(fd)
    assert contents(tmp_path) == before
