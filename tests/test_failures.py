"""What goes wrong, as a hostile user would make it go wrong: each failure must be loud (non-zero exit,
one `error:` line, no traceback), fast, specific (the flag, file, rank or address, and the fix), and
keep what was already done (the previous checkpoint and metrics load and are finite).

The fast cases run in `make test`; those that wait on purpose (stalled ranks, timeouts) are slow.
tests/FAILURES.md names the test of each row.
"""

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    HANG,
    INJECT,
    REPO,
    S01,
    S03,
    S04,
    TRAIN_SIZE,
    checkpoint,
    clean_env,
    finish,
    free_job_id,
    metrics,
    one_error,
    processes_with,
    python,
    ranks,
    run,
    srun_like,
    srun_start,
    stage_args,
    start,
    torchrun,
    torchrun_cmd,
    trained,
    wait_for,
    write_idx_subset,
)  # fmt: skip

from common import cli, data
from common.checkpoint import atomic
from common.guards import divergence, lock, preflight, rails, resume, saving, workers, writes
from common.metrics import Epoch
from common.options import flags

STEPS = 4  # optimizer steps per epoch: 256 training images, batch 64
DIST_TIMEOUT = 120  # far above a start-up on a busy machine (two cores shared: 20 s): a bound that says "no wait"


def kept(folder, epochs):
    """The run's first `epochs` epochs survive: the checkpoint loads, holds them, and is finite; so are the metrics."""
    state = checkpoint(folder)
    assert state["epoch"] == epochs and divergence.finite(state)
    rows = metrics(folder)
    assert len(rows) == epochs and all(math.isfinite(float(r["train_loss"])) for r in rows)
    assert not list(folder.glob("*.tmp*"))


# --- divergence ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_nan_mid_run_stops_at_the_next_progress_line_and_keeps_the_checkpoint(tiny_data, tmp_path):
    # weights turn NaN after the 2nd step of epoch 2; the next progress line (batch 2) stops the run
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 3, "--log-interval", 2),
                 PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_NAN=STEPS + 2)  # fmt: skip
    one_error(
        out, "not finite by epoch 2, batch 2", "nan", "--lr", f"the checkpoint in {tmp_path} keeps the last good epoch"
    )
    kept(tmp_path, 1)


@pytest.mark.slow
def test_weights_that_diverge_in_the_last_step_are_never_saved(tiny_data, tmp_path):
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2),
                 PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_NAN=2 * STEPS)  # fmt: skip
    one_error(out, "epoch 2 left weights that are not finite: the run diverged", "--lr")  # checked before the losses
    kept(tmp_path, 1)


@pytest.mark.slow
def test_a_huge_learning_rate_stops_in_the_first_epoch(tiny_data, tmp_path):
    """Before its first checkpoint: nothing is said to be kept, and the same folder takes the next try (it held
    the dead run's manifest, which refused a fresh run and had no checkpoint to --resume)."""
    out = python(S01, *stage_args(tiny_data, tmp_path, "--lr", 1e30, "--log-interval", 1))
    one_error(out, "not finite by epoch 1", "nothing was saved yet: try a lower --lr")
    assert not (tmp_path / "checkpoint.pt").exists()
    again = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1))
    assert again.returncode == 0 and len(metrics(tmp_path)) == 1, again.stderr[-2000:]


def test_a_non_finite_tensor_is_never_written(tmp_path):
    model = torch.nn.Linear(2, 2)
    assert divergence.finite([model.state_dict(), {"state": {0: {"step": torch.tensor(3.0)}}}])
    with torch.no_grad():
        model.bias[1] = float("inf")
    assert not divergence.finite({"nested": [model.state_dict()]})
    guard = rails.Guard()  # what a stage checks before every save (the end of an epoch, a signal)
    guard.args = SimpleNamespace(output_dir=tmp_path)
    states = {"model": model, "optimizer": torch.optim.SGD(model.parameters())}
    guard.saving = saving.Saving(guard.args, states, False, None, guard.progress)
    with pytest.raises(SystemExit, match="not finite"):
        guard.check_epoch(1, Epoch.read(torch.zeros(3, 3)))
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_divergence_on_one_rank_stops_every_rank_at_the_same_batch(tiny_data, tmp_path):
    procs = ranks(S03, [stage_args(tiny_data, tmp_path, "--epochs", 3, "--log-interval", 2)] * 2,
                  PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=1, FAULT_NAN=STEPS + 1)  # fmt: skip
    rank0, rank1 = finish(procs)
    one_error(rank0, "not finite by epoch 2, batch 2")
    assert rank1.returncode != 0 and "error" not in rank1.stderr
    kept(tmp_path, 1)


# --- one run per output folder ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_exits_at_once_naming_the_first(tiny_data, tmp_path):
    # the first run, stopped (SIGSTOP) once it holds the lock: alive, on no CPU, until the second has ended. Its 8
    # steps sleep 0.5 s each: it cannot end in the moment between its lock and the stop, and trains little after it
    slow = clean_env(PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_SLEEP=0.5)
    first = start(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2), env=slow)
    lock = tmp_path / ".lock"
    wait_for(lambda: lock.exists() and lock.read_text(), proc=first)
    first.send_signal(signal.SIGSTOP)
    try:
        second = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 4))  # a wait for the lock: timed out
        alive = first.poll() is None
    finally:
        first.send_signal(signal.SIGCONT)
    one_error(second, "is in use by another run", f"pid {first.pid}", socket.gethostname())
    assert second.seconds < 15 and alive  # refused while the first runs
    assert first.wait(120) == 0
    kept(tmp_path, 2)


@pytest.mark.slow
def test_a_lock_left_by_a_dead_run_is_taken_over(tiny_data, tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"host": "gone", "pid": 1, "job": None, "since": "yesterday"}))
    assert python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1)).returncode == 0
    assert json.loads((tmp_path / ".lock").read_text())["host"] == socket.gethostname()


def test_a_requeued_job_takes_over_its_own_lock_only(tmp_path):
    """A lock held under the same Slurm job id is taken over only after a requeue (a higher restart count):
    two runs in one job (an salloc shell, two steps into one --output-dir) never displace each other."""
    # as a node that died holding it; another process: a POSIX lock never stops the process that holds it
    hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.lockf(fd, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", hold, tmp_path / ".lock"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    holder.stdout.readline()  # locked
    (tmp_path / ".lock").write_text(json.dumps({"host": "node7", "pid": 99, "job": "77", "restart": 0}))
    for env in ({"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "1"}, {"SLURM_JOB_ID": "77"}):
        with pytest.raises(SystemExit, match="in use by another run .host node7, pid 99, Slurm job 77"):
            lock.claim(tmp_path, env=env)
    lock.claim(tmp_path, env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})  # the same job, requeued
    assert json.loads((tmp_path / ".lock").read_text())["restart"] == 1
    (tmp_path / ".lock").write_text("[1, 2]")  # a lock file some other program wrote
    with pytest.raises(SystemExit, match=r"in use by another run \(host \?, pid \?, since \?\)"):
        lock.claim(tmp_path, env={})
    holder.communicate("")


@pytest.mark.slow
def test_a_killed_run_leaves_its_folder_free_at_once_with_dataloader_workers(tiny_data, tmp_path):
    """SIGKILL (the out-of-memory killer, a lost node) ends a run whose DataLoader workers notice it seconds
    later: they must not keep the folder, or its resume is refused, naming the dead run."""
    args = stage_args(tiny_data, tmp_path, "--epochs", 3, "--num-workers", 1)  # the last --num-workers wins
    run_id = str(uuid.uuid4())
    first = subprocess.Popen([sys.executable, str(S01), *args], env=clean_env(TEST_RUN=run_id), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for((tmp_path / "checkpoint.pt").exists, proc=first)
    workers = [pid for pid in processes_with(f"TEST_RUN={run_id}") if pid != first.pid]
    for pid in workers:  # held up, as by a slow batch: they notice the end of their process only later
        os.kill(pid, signal.SIGSTOP)
    first.kill()
    first.wait()
    try:
        resumed = python(S01, *args, "--resume")
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    assert workers and resumed.returncode == 0 and "resumed after epoch" in resumed.stdout, resumed.stderr


def test_a_live_run_on_this_host_is_never_displaced(tmp_path):
    """A requeue of the same job takes over a lock whose holder Slurm has ended, never one alive on this host:
    a second copy of the job (restart count 1) displaced a live one, and both wrote one checkpoint."""
    hold = ("import sys; from pathlib import Path; from common.guards import lock; "
            "lock.claim(Path(sys.argv[1]), env={'SLURM_JOB_ID': '77'}); print('held', flush=True); sys.stdin.read()")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], env=clean_env(), cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        requeued = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
        with pytest.raises(SystemExit, match=f"in use by another run .host {socket.gethostname()}, pid {holder.pid}, "):
            lock.claim(tmp_path, env=requeued)
    finally:
        holder.communicate("", timeout=HANG)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid


def test_two_writers_of_one_file_never_share_its_temporary_file(tmp_path):
    """Each writer writes its own temporary file: a second one (another process) that opened the same name
    truncated the first's half-written file, and the first's switch then failed. What a killed writer left goes
    when the next run claims the folder."""
    path = tmp_path / "checkpoint.pt"
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f"checkpoint.pt.tmp{gone.pid}").write_bytes(b"half")  # a killed writer's
    other = ("import sys; from pathlib import Path; from common.checkpoint import atomic\n"
             "with atomic(Path(sys.argv[1])) as f: f.write(b'B' * 1000)")  # fmt: skip
    with atomic(path) as f:
        f.write(b"A" * 500)
        f.flush()
        assert run([sys.executable, "-c", other, str(path)]).returncode == 0  # complete while this one writes
        f.write(b"A" * 500)
    assert path.read_bytes() == b"A" * 1000
    lock.sweep(tmp_path)  # the next run's start, once it holds the folder
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_two_runs_in_one_job_get_their_own_folders_and_a_requeue_finds_its_own(tmp_path):
    """Two srun steps of one job write to two folders; the same step of the requeued job to the first's."""
    script = tmp_path / "01_single_gpu" / "train.py"
    step0, step1, requeued = (
        cli.default_output_dir(script, {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": step, "SLURM_RESTART_COUNT": n})
        for step, n in (("0", "0"), ("1", "0"), ("0", "1"))
    )
    assert step0 != step1 and step0 == requeued == tmp_path / "runs/01_single_gpu/77.0"


def test_two_runs_in_the_same_second_get_their_own_folders(tmp_path):
    code = "from pathlib import Path; from common import cli; print(cli.default_output_dir(Path('x/01/train.py')))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=clean_env(), stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    folders = [p.communicate()[0] for p in procs]
    assert folders[0] != folders[1]


@pytest.mark.parametrize("where", ["file", "readonly"])
def test_an_unwritable_output_folder_fails_before_the_data_is_read(where, tmp_path):
    (tmp_path / "file").touch()
    (tmp_path / "readonly").mkdir(mode=0o555)
    folder = tmp_path / where / "run"
    if where == "readonly" and os.access(tmp_path / "readonly", os.W_OK):
        pytest.skip("root writes anywhere")
    out = python(S01, *stage_args(tmp_path / "no-data-here", folder))  # the data would fail next
    said = (
        f"--output-dir {folder} is a file, or inside one"
        if where == "file"
        else f"cannot write to --output-dir {folder}"
    )
    one_error(out, said)  # not the data's error: before it is read ("Not a directory" for a file, before)


# --- a resumed run is the same run --------------------------------------------------------------------


@pytest.mark.slow
def test_a_resume_with_a_changed_defining_option_is_refused_naming_both_values(uninterrupted, tiny_data, tmp_path):
    trained(uninterrupted, tmp_path, S01, "--epochs", 1)  # the run of one epoch, shared
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2, "--resume", "--scheduler", "cosine",
                                  "--weight-decay", 0.1))  # fmt: skip
    one_error(out, "--scheduler step (now cosine)", "--weight-decay 0.0 (now 0.1)")
    # free options may change: more epochs, another log interval
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2, "--resume", "--log-interval", 1))
    assert out.returncode == 0 and "resumed after epoch 1" in out.stdout
    kept(tmp_path, 2)


@pytest.mark.slow
def test_resuming_from_a_model_file_says_it_is_not_a_checkpoint(uninterrupted, tiny_data, tmp_path):
    # the model.pt of the run of one epoch at 2 ranks, shared (conftest.py): stage 01's Net, as stage 01 exports it
    (tmp_path / "a").mkdir()
    shutil.copy(uninterrupted(2, S03, "--epochs", 1, "--save-model") / "model.pt", tmp_path / "a" / "model.pt")
    out = python(S01, *stage_args(tiny_data, tmp_path / "b", "--resume", tmp_path / "a" / "model.pt"))
    one_error(out, "model.pt is not a training checkpoint", "checkpoint.pt")


def test_a_file_the_run_cannot_use_is_told_from_a_full_disk_and_a_temporary_file_by_what_it_replaces(tmp_path):
    """A checkpoint a user made unreadable (chmod 000), or a folder made read-only, was "could not write ...: free
    some space, then resume" with 74 GB free, and named `checkpoint-previous.pt.tmp6645` the previous file kept;
    a run's first save on a full disk said a previous checkpoint was kept where there was none."""
    denied = writes.said(PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "checkpoint.pt")), tmp_path)
    assert denied.startswith(f"error: cannot use {tmp_path / 'checkpoint.pt'}: Permission denied: give the run's user")
    assert "free" not in denied and "resume" not in denied
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoint-previous.pt.tmp6645"))
    first = writes.said(full, tmp_path)
    assert "kept" not in first and first.endswith("then run the same command again"), first
    (tmp_path / "checkpoint-previous.pt").write_text("")
    assert writes.said(full, tmp_path).endswith(": the previous checkpoint-previous.pt is kept; free some space or "
                                                "choose another --output-dir, then resume")  # fmt: skip


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tiny_data, tmp_path):
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 3),
                 PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_ENOSPC=2)  # fmt: skip
    one_error(out, f"could not write {tmp_path / 'checkpoint.pt'}", "No space left", "MiB free", "kept")
    state = checkpoint(tmp_path)
    assert state["epoch"] == 1 and divergence.finite(state) and not list(tmp_path.glob("*.tmp*"))


@pytest.mark.slow
def test_a_resume_on_other_data_is_refused_naming_both_fingerprints(uninterrupted, tiny_data, tmp_path):
    """The run's manifest records what it was trained and tested on (preflight.fingerprint()): a resume on more
    images, or on shifted labels, ran to the end without a word; on another test set too (its rows mixed two test
    sets' numbers: 53 % then 0 %). A checkpoint from before they were recorded resumes."""
    out, more, shifted, tested = tmp_path / "out", tmp_path / "more", tmp_path / "shifted", tmp_path / "tested"
    trained(uninterrupted, out, S01, "--epochs", 1)  # the run of one epoch, shared (on the same images)
    for folder in (more, shifted, tested):
        shutil.copytree(tiny_data / "MNIST", folder / "MNIST")
    for kind in ("images-idx3", "labels-idx1"):  # 32 images more
        write_idx_subset(REPO / "data" / "MNIST" / "raw" / f"train-{kind}-ubyte.gz",
                         more / "MNIST" / "raw" / f"train-{kind}-ubyte", TRAIN_SIZE + 32)  # fmt: skip
    for labels in (
        shifted / "MNIST" / "raw" / "train-labels-idx1-ubyte",
        tested / "MNIST" / "raw" / "t10k-labels-idx1-ubyte",
    ):
        labels.write_bytes(labels.read_bytes()[:8] + bytes((y + 1) % 10 for y in labels.read_bytes()[8:]))
    record = json.loads((out / "run-manifest.json").read_text())["record"]
    recorded = record["data"]
    assert recorded == preflight.fingerprint(data.dataset(tiny_data, "mnist", train=True))
    assert record["test"] == preflight.fingerprint(data.dataset(tiny_data, "mnist", train=False))
    resumed = python(S01, *stage_args(more, out, "--epochs", 2, "--resume"))
    one_error(resumed, "was trained on other data", f"training set was {recorded}, here {TRAIN_SIZE + 32}-")
    resumed = python(S01, *stage_args(tested, out, "--epochs", 2, "--resume"))
    now = preflight.fingerprint(data.dataset(tested, "mnist", train=False))
    one_error(resumed, "was trained on other data", f"test set was {record['test']}, here {now} in --data-dir")
    # rank 0's verdict, in this process: the same number of images, other labels
    args, _ = cli.parse_args(stage_args(shifted, out, "--epochs", 2, "--resume"), [flags.add])
    now = {"data": preflight.fingerprint(data.dataset(shifted, "mnist", train=True)), "test": record["test"]}
    with pytest.raises(SystemExit, match=f"training set was {recorded}, here {now['data']} in --data-dir {shifted}"):
        resume.find(args, out / resume.WHOLE, resume.WHOLE, False, now)
    manifest = json.loads((out / "run-manifest.json").read_text())
    del manifest["record"]["data"]  # as written before the data was recorded: nothing to compare
    (out / "run-manifest.json").write_text(json.dumps(manifest))
    state = torch.load(out / resume.WHOLE, weights_only=True)
    del state["run"]["record"]["data"]  # the checkpoint's own record of its run too (recorded.Stamp)
    torch.save(state, out / resume.WHOLE)
    assert resume.find(args, out / resume.WHOLE, resume.WHOLE, False, now)[0]["epoch"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 20 MiB: stage 01's first checkpoint (14 MiB) fits, a second one beside it does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", disk], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", disk], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("full", ["checkpoint.pt", "metrics.csv"])
def test_a_real_full_disk_keeps_the_previous_checkpoint(full, small_disk, tiny_data):
    """On a real full disk torch.save raises a RuntimeError ('unexpected pos'), not the OSError the test above
    injects. metrics.csv: the disk fills up (another job) during epoch 2, before its row is written."""
    fill = {"metrics.csv": dict(PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_FULL=STEPS + 1)}.get(full, {})
    folder = small_disk / "run"
    out = python(S01, *stage_args(tiny_data, folder, "--epochs", 3), **fill)
    one_error(out, f"could not write {folder / full}: No space left on device", "MiB free", f"previous {full} is kept")
    state = checkpoint(folder)
    assert state["epoch"] == 1 and divergence.finite(state) and not list(folder.glob("*.tmp*"))
    assert len(metrics(folder)) == (2 if full == "checkpoint.pt" else 1)


# --- ranks agree before the first step ----------------------------------------------------------------


@pytest.mark.parametrize("flag, other, named", [("--seed", 2, "--seed: rank 0: 1, rank 1: 2"), pytest.param(
    "--batch-size", 32, "--batch-size: rank 0: 64, rank 1: 32", marks=pytest.mark.slow)])  # fmt: skip
def test_ranks_started_with_different_options_stop_naming_the_option(flag, other, named, tiny_data, tmp_path):
    """Before any wait: rank 0 ends well before a --dist-timeout far above its start-up (a busy machine's too)."""
    args = stage_args(tiny_data, tmp_path, "--dist-timeout", DIST_TIMEOUT)
    rank0, rank1 = finish(ranks(S03, [args, [*args, flag, other]]), timeout=2 * DIST_TIMEOUT)
    one_error(rank0, named)
    assert rank1.returncode != 0 and rank0.seconds < DIST_TIMEOUT


@pytest.mark.slow
def test_ranks_with_different_output_folders_stop_naming_both(tiny_data, tmp_path):
    """A default --output-dir follows SLURM_STEP_ID: ranks started by hand with two step ids took two folders (stage
    04 wrote rank 0's, stage 05 called rank 0's own host blind to its checkpoint)."""
    args = stage_args(tiny_data, tmp_path / "a", "--dist-timeout", 20)
    rank0, rank1 = finish(ranks(S03, [args, [*args, "--output-dir", tmp_path / "b"]]))
    one_error(rank0, f"--output-dir: rank 0: {tmp_path / 'a'}, rank 1: {tmp_path / 'b'}")
    assert rank1.returncode != 0 and rank0.seconds < 20


def test_ranks_given_other_options_that_define_nothing_stop_naming_them(tiny_data, tmp_path):
    """--epochs (or --target, --test-batch-size, --resume on one node alone) defines no run, so no rank compared
    it: node 0 trained one epoch, said "done:" and waited in a collective node 1 never reached, until --dist-timeout,
    naming no option. What a node may have its own of (its data's path, workers, --dist-timeout) may still differ."""
    args = stage_args(tiny_data, tmp_path / "out", "--dist-timeout", 20, "--epochs", 1)
    other = [*stage_args(tmp_path / "elsewhere", tmp_path / "out", "--dist-timeout", 10, "--epochs", 2)]
    (tmp_path / "elsewhere").symlink_to(tiny_data)  # another path to the same data: a node's own copy
    rank0, rank1 = finish(ranks(S03, [args, other]))
    one_error(rank0, "the ranks differ in --epochs: rank 0: 1, rank 1: 2: give every rank the same options")
    assert rank1.returncode != 0 and "done:" not in rank0.stdout  # said before any collective could wait


def test_ranks_reading_different_data_stop_naming_the_data(tiny_data, tmp_path):
    other = tmp_path / "other"
    (other / "MNIST" / "raw").mkdir(parents=True)
    for f in (tiny_data / "MNIST" / "raw").iterdir():
        (other / "MNIST" / "raw" / f.name).write_bytes(f.read_bytes())
    labels = other / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    raw = bytearray(labels.read_bytes())
    raw[8], raw[9] = raw[9], raw[8]  # two labels swapped: same sizes, other data
    labels.write_bytes(bytes(raw))
    out = tmp_path / "out"
    rank0, rank1 = finish(ranks(S03, [stage_args(tiny_data, out), stage_args(other, out)]))
    one_error(rank0, "the ranks differ in the training data set", "rank 1")
    assert rank1.returncode != 0


@pytest.mark.slow
@pytest.mark.parametrize("own", [["--checkpoint-minutes", 1000], []], ids=["1000", "none"])
def test_a_timed_save_is_made_by_every_rank_at_one_step_without_a_collective_per_step(own, tiny_data, tmp_path):
    """Rank 1's own clock never calls for a save (--checkpoint-minutes 1000, or none: a free option, the ranks may
    differ in it): it hears of rank 0's proposal through the store, and both save at the same step, mid-epoch
    though an epoch is shorter than --log-interval. Saves at different steps would pair rank 0's collectives
    of the save with rank 1's of its next step: an error or a hang, never exit status 0. A rank without the flag
    never looked at the proposal: the run hung until --dist-timeout, naming no option."""
    slow = dict(PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_SLEEP=0.1)  # steps longer than 0.001 minutes
    timed = stage_args(tiny_data, tmp_path, "--epochs", 2, "--dist-timeout", 20)
    rank0, rank1 = finish(ranks(S03, [[*timed, "--checkpoint-minutes", 0.001], [*timed, *own]], **slow))
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.stderr + rank1.stderr
    steps = re.findall(r"saved at epoch [12], step (\d) \(--checkpoint-minutes", rank0.stdout)
    assert len(steps) >= 2 and all(0 < int(s) <= STEPS for s in steps), rank0.stdout
    kept(tmp_path, 2)


# --- bounded waits ------------------------------------------------------------------------------------


def test_an_unresolvable_master_addr_fails_at_once(tiny_data, tmp_path):
    """At once: well before a --dist-timeout far above its start-up, which a retrying rank would wait out."""
    args = stage_args(tiny_data, tmp_path, "--dist-timeout", DIST_TIMEOUT)
    (rank1,) = finish(ranks(S03, [None, args], addr="no-such-host.invalid"), timeout=2 * DIST_TIMEOUT)
    one_error(rank1, "MASTER_ADDR no-such-host.invalid does not resolve")
    assert rank1.seconds < DIST_TIMEOUT


@pytest.mark.slow
def test_a_master_port_in_use_is_named(tiny_data, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rank0, rank1 = finish(ranks(S03, [stage_args(tiny_data, tmp_path, "--dist-timeout", 3)] * 2, port=port))
    one_error(rank0, f"MASTER_PORT {port} is in use")
    one_error(rank1, f"127.0.0.1:{port} accepts connections but is no rendezvous store")
    # rank 0 says it at once, before rank 1, which waits out --dist-timeout for a store: measured against each
    # other, not the clock (rank 0 took 16 s to start among the slow suite's processes on two cores, not 15)
    assert rank0.seconds < rank1.seconds < 3 + 5 + 10


@pytest.mark.parametrize("started", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_rank_that_never_starts_is_named_within_the_timeout(started, tiny_data, tmp_path):
    args = [None, None]
    args[started] = stage_args(tiny_data, tmp_path, "--dist-timeout", 3)
    (out,) = finish(ranks(S03, args))
    if started == 0:
        one_error(out, "ranks 1 of 2 did not arrive", "within --dist-timeout 3 s", "srun")
    else:
        one_error(out, "nothing answers at 127.0.0.1", "did you launch with srun or torchrun?")
    # no upper clock (a busy machine's start-up is long): a rank that hung is killed by finish(), without its line
    assert started or out.seconds >= 3  # rank 0 waited out --dist-timeout for rank 1


@pytest.mark.slow
def test_an_srun_task_alone_at_its_jobs_port_names_another_job_id_as_a_cause(tiny_data, tmp_path):
    """Tasks that disagree on SLURM_JOB_ID wait at two ports (20000 + id % 40000) and never meet: the one that
    waited blamed rank 0 alone. Its line names the job id its port comes from."""
    job = free_job_id()
    env = dict(SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost", SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=1)
    out = python(S03, *stage_args(tiny_data, tmp_path, "--dist-timeout", 3), SLURM_STEP_ID=0, **env)
    one_error(out, "nothing answers at localhost", f"or rank 0 has another SLURM_JOB_ID than {job}, whose port this is")


@pytest.mark.slow
def test_a_stalled_rank_is_named_within_the_timeout(tiny_data, tmp_path):
    procs = ranks(S03, [stage_args(tiny_data, tmp_path, "--epochs", 50, "--dist-timeout", 5)] * 2)
    wait_for((tmp_path / "checkpoint.pt").exists, proc=procs[0])  # training for an epoch: past the rendezvous
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        rank0 = finish(procs[:1], timeout=60)[0]
    finally:
        procs[1].kill()
    one_error(rank0, "rank 1 (", "stopped answering", "--dist-timeout 5")
    assert time.monotonic() - stopped < 5 + 10


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_others(tiny_data, tmp_path):
    """SIGKILL (the out-of-memory killer) leaves no message of its own: the survivors name the rank that ended."""
    procs = ranks(S03, [stage_args(tiny_data, tmp_path, "--epochs", 50, "--dist-timeout", 30)] * 2)
    wait_for((tmp_path / "checkpoint.pt").exists, proc=procs[0])  # training for an epoch: past the rendezvous
    procs[1].kill()
    killed = time.monotonic()
    rank0 = finish(procs[:1], timeout=60)[0]
    assert "message is above" not in one_error(rank0, "rank 1 (", "ended or stopped answering", "killed")
    assert time.monotonic() - killed < 15
    kept(tmp_path, int(checkpoint(tmp_path)["epoch"]))


@pytest.mark.slow  # make test: test_preemption.py stops a run mid-epoch with SIGTERM, the same stop
@pytest.mark.parametrize("workers", [0, 1])
def test_ctrl_c_saves_at_a_step_as_sigterm_does(workers, tiny_data, tmp_path):
    """Ctrl-C is a stop like any other (common/guards/signals.py): saved at a step, one line, status 130."""
    cmd = [sys.executable, str(S01), *stage_args(tiny_data, tmp_path, "--epochs", 50, "--num-workers", workers)]
    # as from a terminal: a shell's background job (`make test &`) passes SIGINT on ignored, which Python keeps
    default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default, start_new_session=True)  # fmt: skip
    wait_for((tmp_path / "checkpoint.pt").exists, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to the process group, DataLoader workers included
    out = subprocess.CompletedProcess(cmd, proc.wait(timeout=30), *proc.communicate())
    assert out.returncode == 130 and "Traceback" not in out.stderr and "error" not in out.stderr, out.stderr
    [line] = [line for line in out.stdout.splitlines() if line.startswith("saved at epoch ")]
    assert line.endswith(": resume with --resume (SIGINT)"), line
    epoch, step = (int(n) for n in re.match(r"saved at epoch (\d+), step (\d+)", line).groups())
    assert checkpoint(tmp_path)["epoch"] == epoch and checkpoint(tmp_path)["step"] == step > 0


SEEN_LATE = """
import os, signal, time
import torch
from torch.utils.data._utils import signal_handling
from common.guards import failure, rails
worker = os.fork()  # a DataLoader worker of this process, as torch registers and watches one
if worker == 0:
    time.sleep(60)
    os._exit(0)
signal_handling._set_worker_pids(1, (worker,))
signal_handling._set_SIGCHLD_handler()
class Reset(torch.utils.data.Dataset):  # reading from the worker broke the connection its end closed
    def __len__(self):
        return 1
    def __getitem__(self, i):
        raise ConnectionResetError(104, "Connection reset by peer")
explain = failure.explain_task
def late(err, guard):  # the kernel shows the worker's end (SIGCHLD) only now, as the failure is explained
    os.kill(worker, signal.SIGKILL)
    os.waitid(os.P_PID, worker, os.WEXITED | os.WNOWAIT)
    return explain(err, guard)
failure.explain_task = late
def main(guard):
    next(iter(torch.utils.data.DataLoader(Reset())))
rails.run(main)
"""


def test_a_dataloader_workers_end_seen_as_the_failure_is_explained_is_named():
    """A worker killed while it sent a batch: the loader met the broken connection first, and the kernel showed the
    worker's end while the failure was being explained, where torch's SIGCHLD handler raised its own line. That
    replaced the explanation: the run said "ConnectionResetError ... (at train.py:56)" (in CI, under load). The
    handler is quiet from the failure on; the run asks torch's check of its workers itself (workers.lost())."""
    out = python("-c", SEEN_LATE)
    one_error(out, "DataLoader worker of this rank (pid ", ") ended (killed by signal: Killed)", "out-of-memory")


@pytest.mark.slow
def test_a_dataloader_worker_killed_is_named_with_the_fix(tiny_data, tmp_path):
    """The out-of-memory killer takes a worker: the run names it, the likely cause and --num-workers / --mem."""
    args = stage_args(tiny_data, tmp_path, "--epochs", 50, "--loader", "classic", "--num-workers", 1)  # the last wins
    cmd = [sys.executable, str(S01), *args]
    proc = subprocess.Popen(cmd, env=clean_env(), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for((tmp_path / "checkpoint.pt").exists, proc=proc)
    worker = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    os.kill(worker, signal.SIGKILL)
    out = subprocess.CompletedProcess(cmd, proc.wait(timeout=30), *proc.communicate())
    one_error(out, f"DataLoader worker of this rank (pid {worker})", "out-of-memory", "--num-workers", "--mem")
    kept(tmp_path, len(metrics(tmp_path)))


def test_a_worker_killed_as_it_sends_a_batch_is_named_not_the_connection_it_broke():
    """A worker killed while it sends a batch breaks the connection before the kernel lets its end be seen: the
    loader, which found it alive, raised ConnectionResetError, and the run's line named that (CI, under load). The
    line names the worker, as when the loader sees it die; a worker alive is not blamed for a broken connection."""
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), num_workers=1)
    alive, dead = iter(batches), iter(batches)
    next(alive), next(dead)
    default = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise anywhere in this test
    try:
        assert workers.lost(broken(alive)) is None
        os.kill(pid := dead._workers[0].pid, signal.SIGKILL)
        line = workers.lost(broken(dead))
    finally:
        signal.signal(signal.SIGCHLD, default)
    assert (line or "").startswith(
        f"error: a DataLoader worker of this rank (pid {pid}) ended (killed by signal: Killed)"
    )
    assert "out-of-memory killer" in line and line.endswith("continue with --resume"), line


def broken(batches):
    """What the loader raises where the connection to its worker broke and the worker still looked alive."""

    def reset(*args, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    batches._data_queue.get, batches._workers[0].is_alive = reset, lambda: True
    with pytest.raises(ConnectionResetError) as raised:
        next(batches)
    return raised.value


@pytest.mark.slow
def test_a_killed_torchrun_takes_its_workers_with_it(tiny_data, tmp_path):
    marker = f"RUN_MARKER={tmp_path.name}"
    env = clean_env(RUN_MARKER=tmp_path.name)
    launcher = subprocess.Popen(torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 50)), env=env,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wait_for((tmp_path / "checkpoint.pt").exists, proc=launcher)
    workers = [pid for pid in processes_with(marker) if pid != launcher.pid]
    assert len(workers) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(pid in processes_with(marker) for pid in workers):
        assert time.monotonic() < deadline, "the workers outlived their torchrun"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_run_that_succeeded_ends_with_status_0_when_gloo_frees_a_tensor_at_exit(tiny_data, tmp_path):
    """gloo's thread frees a late collective's tensor after the rank's last line (tests/inject: LATE_RELEASE):
    it needs the GIL, and in the interpreter's teardown taking it ends the thread inside C++, which aborts
    the process (SIGABRT, "terminate called without an active exception"). A rank skips that teardown."""
    env = clean_env(PYTHONPATH=f"{INJECT}:{REPO}", LATE_RELEASE=2)
    out = torchrun(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 1), env=env)
    assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-3000:]
    assert "done: 1 epochs" in out.stdout and len(metrics(tmp_path)) == 1


@pytest.mark.slow
def test_a_run_started_with_stdout_closed_ends_with_status_0(tiny_data, tmp_path):
    """`>&-`: Python's sys.stdout is None; the ranks' own ending (common/guards/ending.py) flushes only what exists."""
    cmd = torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 1))
    out = subprocess.run(cmd, env=clean_env(), cwd=REPO, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(1))  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(metrics(tmp_path)) == 1


def test_the_failure_table_names_real_tests():
    """Every test tests/FAILURES.md names exists: `file.py::test`, then bare names from the same file."""
    named = 0
    for row in (REPO / "tests" / "FAILURES.md").read_text().splitlines():
        if not row.startswith("| ") or "`" not in row.split("|")[-2]:
            continue
        file = None
        for ref in re.findall(r"`([^`]+)`", row.split("|")[-2]):
            file, _, name = ref.rpartition("::") if "::" in ref else (file, "", ref)
            assert re.search(rf"^def {name}\(", (REPO / "tests" / file).read_text(), re.M), ref
            named += 1
    assert named >= 40


# 1: one rank raises; the others must not block in a collective forever
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["torchrun", "srun"])
def test_one_failing_rank_ends_the_run(launch, tiny_data, tmp_path):
    marker = f"TEST_RUN={uuid.uuid4()}"
    env = dict(PYTHONPATH=INJECT, FAULT_RANK=1, FAULT_STEP=3, TEST_RUN=marker.split("=")[1])
    began = time.monotonic()
    if launch == "torchrun":
        out = run(torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 3)), env=clean_env(**env))
        codes, output = [out.returncode], out.stdout + out.stderr
    else:
        codes, outputs = srun_like(2, S04, *stage_args(tiny_data, tmp_path, "--epochs", 3), **env)
        output = "".join(outputs)
    assert all(codes) and time.monotonic() - began < 60, output
    assert "injected fault: rank 1 at step 3" in output
    wait_for(lambda: not processes_with(marker), timeout=5)


# 9: every rank downloads / compute node offline
@pytest.mark.slow
def test_missing_data_fails_every_rank_fast(tmp_path):
    began = time.monotonic()
    out = torchrun(2, S03, *stage_args(tmp_path / "empty", tmp_path))
    assert out.returncode != 0 and time.monotonic() - began < 30
    assert out.stderr.count("tools/prepare_data.py") >= 2  # each rank says why, and what to do


# 10: two jobs on one node pick the same MASTER_PORT
@pytest.mark.slow
def test_two_jobs_on_one_node_run_side_by_side(tiny_data, tmp_path):
    # both jobs' ranks started before either is waited for (srun_start): the two steps at once, as on a shared node
    jobs = [
        srun_start(2, S04, *stage_args(tiny_data, tmp_path / str(job_id), "--epochs", 1), job_id=job_id)
        for job_id in (3001, 3002)
    ]
    try:
        outputs = [[p.communicate(timeout=120)[0] for p in job] for job in jobs]
    finally:
        for p in jobs[0] + jobs[1]:
            p.kill()
    assert [[p.returncode for p in job] for job in jobs] == [[0, 0], [0, 0]], outputs


# 14: batch size not divisible by the world size, zero or negative values
@pytest.mark.slow
@pytest.mark.parametrize("flag, message", [(("--batch-size", 64), "--batch-size 64"), (("--epochs", 0), "--epochs")])
def test_bad_numbers_fail_before_any_process_group(flag, message, tiny_data, tmp_path):
    """Refused by every rank before the rendezvous: no rank waits --dist-timeout (300 s) for another. The bound is
    the start of three ranks importing torch on a machine the suite keeps busy (6 to 17 s alone), not that wait."""
    began = time.monotonic()
    out = torchrun(3, S03, *stage_args(tiny_data, tmp_path, *flag))
    seconds = time.monotonic() - began
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "init_process_group" not in out.stderr, out.stderr
    assert seconds < 60, (seconds, out.stderr)
