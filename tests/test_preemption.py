"""A time limit, a preemption or a scancel loses at most the step in flight: SIGTERM or SIGUSR1 mid-epoch
saves the run where it stands, in seconds, with one line, and the resumed run is the run it would have
been (bit-identical weights; at another world size, every sample of the epoch seen once)."""

import itertools
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    INJECT,
    KILL_WAIT,
    REPO,
    S01,
    S03,
    S04,
    S05,
    TRAIN_SIZE,
    assert_same_state,
    checkpoint,
    clean_env,
    metrics,
    one_error,
    processes_with,
    python,
    srun_start,
    stage_args,
    start,
    torchrun,
    wait_for,
    wait_for_epoch,
)  # fmt: skip
from torch.utils.data import DistributedSampler

from common.guards import resume
from common.guards.versions import release
from common.options import resuming

BATCH = 32  # 8 steps per epoch of the 256 training images
SLOW = dict(PYTHONPATH=INJECT, FAULT_RANK=0, FAULT_SLEEP=0.3)  # rank 0's steps take 0.3 s: time to signal mid-epoch


def args(data, out, *extra):
    return stage_args(data, out, "--epochs", 2, "--batch-size", BATCH, *extra)


def whole_run(uninterrupted):
    """Stage 01's run of args() never stopped, shared by the tests (conftest.py): what each stopped one resumes to."""
    return uninterrupted("python", S01, "--epochs", 2, "--batch-size", BATCH)


def signal_mid_epoch_2(proc, out, signum, *others, everyone=None):
    """Once epoch 1 is saved, wait two steps, then send `signum` to `proc` (and to `others`), or to every
    process whose environment holds `everyone` (NAME=value), as Slurm signals every process of a step: the
    launcher, the ranks and their DataLoader workers. Returns its output and the seconds from the signal to its
    exit."""
    wait_for_epoch(out, 1, proc)
    time.sleep(0.6)
    sent = time.monotonic()
    if everyone:
        pids = processes_with(everyone)
        assert "pt_data_worker\n" in [Path(f"/proc/{pid}/comm").read_text() for pid in pids]  # torch names them
        for pid in pids:
            os.kill(pid, signum)
    else:
        for p in (proc, *others):
            p.send_signal(signum)
    output = proc.communicate(timeout=60)[0]
    return output, time.monotonic() - sent


def stopped_and_resumed(script, data, whole, cut, *flags):
    """args()'s run at 2 ranks under torchrun never stopped, into `whole`, and stopped by SIGTERM mid-epoch 2 and
    resumed, into `cut`: for the test to compare."""
    assert torchrun(2, script, *args(data, whole, *flags)).returncode == 0
    proc = start(script, *args(data, cut, *flags), nproc=2, env=clean_env(**SLOW))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    saved_mid_epoch(cut, output, proc.returncode, proc)
    resumed = torchrun(2, script, *args(data, cut, *flags, "--resume"))
    assert resumed.returncode == 0 and "resumed at epoch 2" in resumed.stdout, resumed.stderr[-2000:]


def saved_mid_epoch(out, output, code, proc):
    """The run stopped as it should have: its exit code, its one line, and the checkpoints."""
    assert proc.returncode == code, output
    lines = [line for line in output.splitlines() if line.startswith("saved at epoch 2, step ")]
    assert len(lines) == 1 and lines[0].split(":")[1].startswith(" resume with --resume"), output
    step = int(lines[0].split("step ")[1].split(":")[0])
    assert 0 < step < TRAIN_SIZE // BATCH, output
    # torchrun, signalled itself, ends with a traceback of its own (SignalException); the run has none
    assert output.count("Traceback") == output.count("elastic.multiprocessing.api.SignalException: Process"), output
    return step


@pytest.mark.parametrize("size", [511, 13, 12])
def test_a_resumed_epoch_deals_each_rank_what_it_would_have_trained(size):
    """Resumed at the world size it stopped at, each rank gets the rest of its own share of the epoch, padding
    included: an odd training set was padded with the first sample left, where DistributedSampler pads with the
    epoch's first (511 images at 2 ranks resumed to other weights, every one). At another world size: every sample
    left, in shares of one length (a rank with one step more would wait for ever in a collective)."""
    data = range(size)

    def share(ranks, rank, skip=None):
        sampler = DistributedSampler(data, ranks, rank, seed=1)
        sampler = resuming.Resumable(sampler, 1) if skip is not None else sampler
        sampler.set_epoch(3)
        if skip is not None:
            sampler.resume_at(3, skip)
        return list(sampler)

    for ranks, batch in itertools.product((2, 3, 4), (1, 4)):
        for steps, rank in itertools.product(range(-(-size // (batch * ranks)) + 1), range(ranks)):
            assert share(ranks, rank, steps * batch * ranks) == share(ranks, rank)[steps * batch :]
    order = share(1, 0)
    for ranks, skip in itertools.product((2, 3, 5), (0, 4, 8, 12)):  # saved at 4 ranks, batches of 1
        shares = [share(ranks, rank, skip) for rank in range(ranks)]
        dealt, left = [*itertools.chain(*shares)], order[skip:]
        assert len({len(s) for s in shares}) == 1 and set(left) <= set(dealt) and len(dealt) - len(left) < ranks


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGTERM,
        *(pytest.param(s, marks=pytest.mark.slow) for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGINT)),
    ],
)
def test_stage01_stopped_mid_epoch_resumes_bit_identical(signum, uninterrupted, tiny_data, tmp_path):
    """SIGHUP (a closed ssh session) and SIGINT (Ctrl-C) stop a run as SIGTERM does: SIGHUP ended it unsaved."""
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    proc = start(S01, *args(tiny_data, cut), env=clean_env(**SLOW))
    output, seconds = signal_mid_epoch_2(proc, cut, signum)
    step = saved_mid_epoch(cut, output, 128 + signum, proc)
    assert seconds < KILL_WAIT, seconds  # the step in flight (0.3 s here), the save and the exit: within KillWait
    assert checkpoint(cut)["step"] == step and checkpoint(cut)["epoch"] == 2
    assert checkpoint(cut, resume.PREVIOUS)["epoch"] == 1  # the one before survives
    resumed = python(S01, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stdout
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])
    rows = metrics(cut)
    assert len(rows) == 2 and float(rows[1]["epoch_seconds"]) > 0.6  # epoch 2's time, across the interruption


@pytest.mark.slow
def test_stage03_under_torchrun_stopped_by_sigterm_resumes_bit_identical(uninterrupted, tiny_data, tmp_path):
    whole, cut = uninterrupted(2, S03, "--epochs", 2, "--batch-size", BATCH), tmp_path / "cut"  # conftest.py: shared
    proc = start(S03, *args(tiny_data, cut), nproc=2, env=clean_env(**SLOW))
    output, seconds = signal_mid_epoch_2(proc, cut, signal.SIGTERM)  # to torchrun, which passes it on
    assert proc.returncode != 0 and seconds < 35, output
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    resumed = torchrun(2, S03, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_stage01_with_dataloader_workers_saves_when_every_process_is_signalled(tiny_data, tmp_path):
    """Slurm signals every process of a step (scancel, a preemption), `kill -- -PGID` a process group: the
    DataLoader workers get the signal too, and leave it to their rank, which saves."""
    cut, run = tmp_path / "cut", str(uuid.uuid4())
    proc = start(S01, *args(tiny_data, cut, "--num-workers", 1), env=clean_env(**SLOW, TEST_RUN=run))
    output, seconds = signal_mid_epoch_2(proc, cut, signal.SIGTERM, everyone=f"TEST_RUN={run}")
    step = saved_mid_epoch(cut, output, 128 + signal.SIGTERM, proc)
    assert "error" not in output and seconds < 15, output
    resumed = python(S01, *args(tiny_data, cut, "--resume", "--num-workers", 1))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr


PASS_ON = re.search(r"PET_SIGNALS_TO_HANDLE=(\S+)", (REPO / "03_ddp_single_node/job.slurm").read_text())[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, everyone",
    [(signal.SIGTERM, True), (signal.SIGUSR1, False), (signal.SIGUSR1, True)],
    ids=["SIGTERM to every process", "SIGUSR1 to torchrun", "SIGUSR1 to every process"],
)
def test_stage03_under_torchrun_with_workers_saves_however_the_signal_comes(signum, everyone, tiny_data, tmp_path):
    """torchrun passes the signal on to each worker's process group, DataLoader workers included, or Slurm
    signals all of them at once (--signal=USR1@90 without B:, scancel --signal=USR1): SIGUSR1 as the job
    scripts' PET_SIGNALS_TO_HANDLE tells torchrun to, from torch 2.10."""
    if signum == signal.SIGUSR1 and release(torch.__version__) < (2, 10):
        pytest.skip("torchrun passes SIGUSR1 on from torch 2.10; an older one ends by it (README)")
    cut, run = tmp_path / "cut", str(uuid.uuid4())
    env = clean_env(**SLOW, TEST_RUN=run, PET_SIGNALS_TO_HANDLE=PASS_ON)  # as the job scripts export it
    proc = start(S03, *args(tiny_data, cut, "--num-workers", 1), nproc=2, env=env)
    output, seconds = signal_mid_epoch_2(proc, cut, signum, everyone=everyone and f"TEST_RUN={run}")
    # no line of the run's says error:. torchrun's agent, signalled with its workers, may abort once they have
    # saved and ended ("terminate called without an active exception", "Fatal Python error: Aborted": torch's own)
    assert proc.returncode != 0 and seconds < 35 and not re.search("^error:", output, re.MULTILINE), output
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    assert f"({signal.Signals(signum).name})" in output
    resumed = torchrun(2, S03, *args(tiny_data, cut, "--resume", "--num-workers", 1))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr


@pytest.mark.slow
def test_a_signal_to_one_rank_of_a_manual_launch_stops_both_at_one_step(tiny_data, tmp_path):
    """Ranks started by hand (srun-style variables): rank 1 alone is signalled; rank 0 hears of it through
    the store, and both save at the same step."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    procs = srun_start(2, S04, *args(tiny_data, whole))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    procs = srun_start(2, S04, *args(tiny_data, cut), **SLOW)
    output, seconds = signal_mid_epoch_2(procs[1], cut, signal.SIGUSR1)
    assert procs[0].wait(timeout=30) == 128 + signal.SIGUSR1 and procs[1].returncode == 128 + signal.SIGUSR1
    step = saved_mid_epoch(cut, procs[0].communicate()[0], 128 + signal.SIGUSR1, procs[0])
    procs = srun_start(2, S04, *args(tiny_data, cut, "--resume"))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and f"resumed at epoch 2, step {step}" in outputs[0], outputs
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_stage05_saved_mid_epoch_at_two_ranks_resumes_at_one_seeing_every_sample_once(tiny_data, tmp_path):
    cut, record = tmp_path / "cut", tmp_path / "batches.jsonl"
    proc = start(S05, *args(tiny_data, cut), nproc=2, env=clean_env(**SLOW, RECORD_BATCHES=record))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    assert (cut / f"epoch-2-step-{step}").is_dir() and (cut / "epoch-1").is_dir()
    resumed = python(S05, *args(tiny_data, cut, "--resume"), PYTHONPATH=INJECT, RECORD_BATCHES=record)
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    batches = [json.loads(line) for line in record.read_text().splitlines()]
    seen = Counter(i for b in batches if b["size"] == TRAIN_SIZE for i in b["indices"])
    assert seen == Counter({i: 2 for i in range(TRAIN_SIZE)})  # two epochs: each image twice, no more, no less
    rows = metrics(cut)
    assert [r["epoch"] for r in rows] == ["1", "2"] and rows[1]["world_size"] == "1"


BATCHNORM = """from torch import nn

from common.tasks.images import *  # noqa: F403 (MNIST)


def model(args):
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10))  # fmt: skip
"""


@pytest.mark.slow
def test_stage05_stopped_mid_epoch_keeps_each_ranks_batchnorm_statistics(tiny_data, tmp_path):
    """FSDP shards no buffer and averages BatchNorm's statistics only before an evaluation: mid-epoch each rank's
    are its own, and the shards hold one copy. The resumed run gave every rank rank 0's, and its statistics, test
    loss and exported model differed from the run never stopped (weights alike)."""
    task, whole, cut = tmp_path / "bn.py", tmp_path / "whole", tmp_path / "cut"
    task.write_text(BATCHNORM)
    stopped_and_resumed(S05, tiny_data, whole, cut, "--task", task, "--save-model")
    assert_same_state(checkpoint(cut, "model.pt"), checkpoint(whole, "model.pt"))
    assert [r["test_loss"] for r in metrics(cut)] == [r["test_loss"] for r in metrics(whole)]


@pytest.mark.slow
def test_a_second_signal_during_the_save_changes_nothing(uninterrupted, tiny_data, tmp_path):
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    env = clean_env(**SLOW, FAULT_SLOW_SAVE=1.0)  # each save takes a second: time for a second signal
    proc = start(S01, *args(tiny_data, cut), env=env)
    wait_for_epoch(cut, 1, proc)
    time.sleep(1.6)  # past epoch 1's save, into epoch 2
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.8)  # the step in flight ends, the save starts
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    step = saved_mid_epoch(cut, output, 128 + signal.SIGTERM, proc)
    resumed = python(S01, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_torchrun_ended_by_a_third_ctrl_c_during_a_save_loses_nothing(uninterrupted, tiny_data, tmp_path):
    """Ctrl-C pressed three times while a checkpoint is written (a slow file system): torchrun's agent ends at once
    at the third (torch's own handling), its store with it. Each worker, seeing its torchrun gone, ended in the
    middle of the save: the checkpoint lost, its temporary file left. Now the save is finished first, the run says
    where it saved, and resumes as it would have run."""
    cut = tmp_path / "cut"
    proc = start(S03, *args(tiny_data, cut), nproc=2, env=clean_env(**SLOW, FAULT_SLOW_SAVE=3))
    wait_for_epoch(cut, 1, proc)
    wait_for(lambda: (cut / "checkpoint.pt").exists(), 30, proc)  # epoch 1's save (3 s) is done
    time.sleep(0.6)  # two steps into epoch 2
    for _ in range(3):  # the first passed on to the ranks, which save for 3 s; the third ends torchrun
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    output = proc.communicate(timeout=60)[0]
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    assert not [name for name in os.listdir(cut) if ".tmp" in name], os.listdir(cut)
    resumed = torchrun(2, S03, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    whole = uninterrupted(2, S03, "--epochs", 2, "--batch-size", BATCH)
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_signals_during_the_exit_change_neither_the_status_nor_the_line(tiny_data, tmp_path):
    """SIGTERM again and again once the run has saved, while it exits (a second scancel, Slurm's signal to
    every process): the exit status stays 143, not the end by a signal that Python's teardown would allow."""
    proc = start(S01, *args(tiny_data, tmp_path), env=clean_env(**SLOW))
    wait_for_epoch(tmp_path, 1, proc)
    time.sleep(0.6)
    proc.send_signal(signal.SIGTERM)
    lines = []
    while not (lines and lines[-1].startswith("saved at")) and proc.poll() is None:
        lines.append(proc.stdout.readline())
    sent = 0
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.001)
    saved_mid_epoch(tmp_path, "".join(lines) + proc.stdout.read(), 128 + signal.SIGTERM, proc)
    assert sent >= 10, sent  # the exit took long enough for them to land in it


@pytest.mark.slow
def test_a_signal_after_rank_0_was_killed_is_one_line_per_rank_left(tiny_data, tmp_path):
    """The out-of-memory killer takes rank 0, whose process served the rendezvous store; srun
    (--kill-on-bad-exit) then sends the others SIGTERM. No step can be agreed without the store: one line
    naming it, no traceback, and the last checkpoint stays."""
    procs = srun_start(2, S04, *args(tiny_data, tmp_path), **SLOW)
    wait_for_epoch(tmp_path, 1, procs[0])
    time.sleep(0.6)
    procs[0].kill()
    time.sleep(0.5)  # rank 1 is in the collective that fails, or naming the rank that went silent
    procs[1].send_signal(signal.SIGTERM)
    output = procs[1].communicate(timeout=60)[0]
    procs[0].wait()
    # the signal lands while rank 1 names the failed collective (it waits for that line: the cause, rank 0 gone
    # with its store), or before it does (then no step can be agreed: "SIGTERM came, but ... is gone")
    one_error(subprocess.CompletedProcess(procs[1].args, procs[1].returncode, output, output), "rank 1: ", "is gone")
    assert checkpoint(tmp_path)["epoch"] == 1 and checkpoint(tmp_path)["step"] == 0


@pytest.mark.slow
def test_checkpoint_minutes_saves_mid_epoch_for_a_sigkill(uninterrupted, tiny_data, tmp_path):
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    often = ("--checkpoint-minutes", 0.001, "--log-interval", 1)  # at every progress line: every step here
    proc = start(S01, *args(tiny_data, cut, *often), env=clean_env(**SLOW))
    wait_for(lambda: (cut / "checkpoint.pt").exists() and checkpoint(cut)["epoch"] == 2, 90, proc)
    proc.kill()  # no signal to catch: what the interval saved is what there is
    proc.wait()
    step = checkpoint(cut)["step"]
    resumed = python(S01, *args(tiny_data, cut, "--resume"))  # a free option: resumes without it
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_checkpoint_minutes_saves_mid_epoch_in_an_epoch_shorter_than_the_log_interval(
    uninterrupted, tiny_data, tmp_path
):
    """8 steps an epoch and a progress line every 100 (the default): the clock was looked at on progress lines
    only, so no save ever came mid-epoch. It is looked at every step now."""
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    slow = clean_env(**SLOW | {"FAULT_SLEEP": 0.1})  # steps longer than the 0.06 s of --checkpoint-minutes 0.001
    proc = start(S01, *args(tiny_data, cut, "--checkpoint-minutes", 0.001), env=slow)
    wait_for(lambda: (cut / "checkpoint.pt").exists() and checkpoint(cut)["epoch"] == 2 and checkpoint(cut)["step"],
             proc=proc)  # fmt: skip
    proc.kill()
    output = proc.communicate()[0]
    assert "saved at epoch 1, step " in output, output  # mid-epoch in the first epoch too
    step = checkpoint(cut)["step"]
    resumed = python(S01, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


# dropout over the tokens of a batch of texts of many lengths: each rank draws as many numbers as its batch holds
DROPPED_TEXT = """
import torch.nn.functional as F
from common.tasks.text import add_arguments, check, collate, datasets, model as bag

def model(args):
    net = bag(args)
    net.embed.register_forward_hook(lambda layer, inputs, out: F.dropout(out, 0.1, layer.training))
    return net
"""


@pytest.mark.slow
def test_each_rank_resumes_with_its_own_random_generators(tmp_path):
    """Two ranks whose draws differ (dropout over their own batches' tokens): the checkpoint held rank 0's
    generators alone, each rank got them back, and the resumed run's weights were another run's (0.01 apart)."""
    task, whole, cut = tmp_path / "task.py", tmp_path / "whole", tmp_path / "cut"
    task.write_text(DROPPED_TEXT)

    def options(out, epochs, *more):
        return ["--task", task, "--epochs", epochs, "--samples", 512, "--batch-size", 64, "--output-dir", out, *more]

    for argv in (options(whole, 2), options(cut, 1), options(cut, 2, "--resume")):
        ran = torchrun(2, S03, *argv, timeout=600)
        assert ran.returncode == 0, ran.stderr[-2000:]
    for part in ("model", "optimizer", "rng"):
        assert_same_state(checkpoint(cut)[part], checkpoint(whole)[part], part)
    ranks = checkpoint(cut)["rng"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["cpu"], ranks[1]["cpu"])  # the ranks drew unlike


@pytest.mark.slow
def test_checkpoint_minutes_says_saved_only_for_a_save_it_writes(tmp_path):
    """An evaluation longer than --checkpoint-minutes: the save at the epoch's last step stands, and each later
    evaluation batch skipped it, yet said "saved at epoch 1, step 31" again at each: 26 lines for 11 checkpoints."""
    often = ("--checkpoint-minutes", 0.003, "--limit", 1024, "--test-batch-size", 32, "--epochs", 1)
    out = python(S01, *args(REPO / "data", tmp_path, *often))
    assert out.returncode == 0, out.stderr
    said = re.findall(r"saved at epoch 1, step (\d+) \(--checkpoint-minutes", out.stdout)
    assert said and len(said) == len(set(said)), out.stdout  # each step once: each line a checkpoint written


def test_a_signal_set_after_the_scripts_first_command_is_none():
    """sbatch reads #SBATCH lines up to the first command: a --signal after `set -euo pipefail` is one Slurm never
    sends, and the doctor said PASS ("Requeue=1, --signal=B:USR1@90") to that job."""
    from common.guards.preemption import script_signal

    head = "#!/bin/bash\n#SBATCH --nodes=1\n\n# the site's block\n"
    assert script_signal(head + "#SBATCH --signal=B:USR1@90\nset -euo pipefail\n") == "B:USR1@90"
    assert script_signal(head + "set -euo pipefail\n#SBATCH --signal=B:USR1@90\n") is None
    for job in sorted(REPO.glob("*/job*.slurm")) + [REPO / "tools" / "doctor.slurm"]:  # the project's own
        assert script_signal(job.read_text()) == "B:USR1@90", job
