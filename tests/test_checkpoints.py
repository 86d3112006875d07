"""Checkpoints a run can trust: the last two complete ones kept, a damaged one named by file with the one
before it to resume from, and no fresh run over a folder that holds any stage's checkpoint."""

import io
import json
import operator
import os
import pickle
import re
import shutil
import signal
import sys

import pytest
import torch
from helpers import (
    INJECT,
    REPO,
    S01,
    S03,
    S04,
    S05,
    assert_same_state,
    checkpoint,
    clean_env,
    free_job_id,
    kill_rank_1_after_a_checkpoint,
    one_error,
    python,
    run,
    srun_like,
    stage_args,
    start,
    torchrun,
    trained,
    wait_for,
)  # fmt: skip

from common import checkpoint as lesson
from common import cli, metrics, shards
from common.guards import ownership, preflight, randomness, recorded, resume, safeload, saving
from common.models import Net
from common.options import flags


def small(script, data_dir, out, *extra):
    return run([sys.executable, str(script), *stage_args(data_dir, out, "--limit", 64, *extra)], env=clean_env())


@pytest.mark.slow
def test_a_file_resume_names_outside_the_run_is_never_advised_for_deletion(tiny_data, tmp_path):
    """--resume of a user's file that is no checkpoint (a typo: /etc/passwd): refused in one line that points to
    another checkpoint; the run's own damaged file may be deleted, the user's is never named for it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    line = one_error(small(S01, tiny_data, tmp_path / "out", "--resume", notes), str(notes), "another checkpoint")
    assert "delete" not in line and notes.read_text() == "not a checkpoint"


@pytest.mark.slow
def test_a_damaged_checkpoint_names_itself_and_the_previous_one_resumes(uninterrupted, tiny_data, tmp_path):
    trained(uninterrupted, tmp_path, S01, "--limit", 64, "--epochs", 2)  # small()'s run, shared
    previous = tmp_path / resume.PREVIOUS
    assert checkpoint(tmp_path, resume.PREVIOUS)["epoch"] == 1  # the epoch before checkpoint.pt's
    latest = tmp_path / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[:1000])  # truncated by a failing disk, or by hand
    out = small(S01, tiny_data, tmp_path, "--epochs", 3, "--resume")
    one_error(
        out,
        f"{latest} is not a checkpoint this code wrote, or is damaged",
        "epoch 1 is complete",
        f"--resume {previous}",
    )
    out = small(S01, tiny_data, tmp_path, "--epochs", 3, "--resume", previous)
    assert out.returncode == 0, out.stderr
    assert "resumed after epoch 1" in out.stdout and checkpoint(tmp_path)["epoch"] == 3


def test_a_checkpoint_copied_away_from_its_run_is_refused_not_resumed_unchecked(tiny_data, tmp_path):
    """A checkpoint.pt copied alone into another folder, --resume PATH: nothing said what run it is, so no option
    was compared (--lr 0.1 went unused: the optimizer's rate is the checkpoint's) and the run exited 0."""
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters())
    states = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))
    (tmp_path / "copied").mkdir()
    lesson.save(tmp_path / "copied", 1, states)  # a checkpoint.pt, and no run-manifest.json beside it
    args, _ = cli.parse_args(
        stage_args(tiny_data, tmp_path / "new", "--lr", 0.1, "--resume", tmp_path / "copied"), [flags.add]
    )
    path = tmp_path / "copied" / "checkpoint.pt"
    with pytest.raises(SystemExit, match=f"^error: {path} has no run-manifest.json beside it"):
        resume.find(args, path, resume.WHOLE, False, {"data": "256-0"})


@pytest.mark.slow
def test_another_runs_checkpoint_copied_into_a_runs_folder_is_refused(tiny_data, tmp_path):
    """Run b's checkpoint.pt copied over run a's: a's --resume trained b's run (its --lr 0.5, which a's manifest did
    not record) and exited 0. Each checkpoint holds the id and record of the run that wrote it (recorded.Stamp):
    one line naming both runs, the file's own record where no manifest is beside it."""
    for name, lr in (("a", 1.0), ("b", 0.5)):
        assert small(S01, tiny_data, tmp_path / name, "--epochs", 1, "--lr", lr).returncode == 0
    theirs, ours = (ownership.read(tmp_path / name)["run"] for name in ("b", "a"))
    assert checkpoint(tmp_path / "b")["run"]["id"] == theirs and theirs != ours
    shutil.copy(tmp_path / "b" / "checkpoint.pt", tmp_path / "a" / "checkpoint.pt")
    out = small(S01, tiny_data, tmp_path / "a", "--epochs", 2, "--resume")
    one_error(
        out, f"{tmp_path / 'a' / 'checkpoint.pt'} is a checkpoint of run {theirs}, not of run {ours}", "delete it"
    )
    (tmp_path / "alone").mkdir()  # copied away alone: what defines it, from the file itself
    shutil.copy(tmp_path / "b" / "checkpoint.pt", tmp_path / "alone" / "checkpoint.pt")
    out = small(S01, tiny_data, tmp_path / "c", "--epochs", 2, "--resume", tmp_path / "alone" / "checkpoint.pt")
    one_error(out, "was written with --lr 0.5 (now 1.0)")
    out = small(
        S01, tiny_data, tmp_path / "c", "--epochs", 2, "--lr", 0.5, "--resume", tmp_path / "alone" / "checkpoint.pt"
    )
    assert out.returncode == 0 and "resumed after epoch 1" in out.stdout, out.stderr


@pytest.mark.slow  # the whole-checkpoint case above runs in make test
def test_a_damaged_shard_or_missing_metadata_is_named_by_file(uninterrupted, tiny_data, tmp_path):
    """Stage 05 keeps its last two sharded checkpoints (one process: the shards of one rank)."""
    trained(uninterrupted, tmp_path, S05, "--limit", 64, "--epochs", 2)  # small()'s run, shared
    assert [f.name for f in resume.epochs(tmp_path)] == ["epoch-2", "epoch-1"]
    out = small(S05, tiny_data, tmp_path, "--epochs", 3, "--resume", tmp_path / "epoch-2" / "state.pt")
    one_error(out, "is one file of a sharded checkpoint: give its folder", str(tmp_path / "epoch-2"))
    shard = next((tmp_path / "epoch-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    out = small(S05, tiny_data, tmp_path, "--epochs", 3, "--resume")
    one_error(out, f"{shard} is truncated", f"--resume {tmp_path / 'epoch-1'}")
    (tmp_path / "epoch-2" / ".metadata").unlink()
    one_error(
        small(S05, tiny_data, tmp_path, "--epochs", 3, "--resume"), f"{tmp_path / 'epoch-2' / '.metadata'} is missing"
    )
    shutil.rmtree(tmp_path / "epoch-2")  # the link names a folder that is gone: the one before is named
    out = small(S05, tiny_data, tmp_path, "--epochs", 3, "--resume")
    one_error(out, f"{tmp_path / 'checkpoint'} names epoch-2, which is gone", f"--resume {tmp_path / 'epoch-1'}")
    out = small(S05, tiny_data, tmp_path, "--epochs", 3, "--resume", tmp_path / "epoch-1")
    assert out.returncode == 0, out.stderr
    assert [f.name for f in resume.epochs(tmp_path)] == ["epoch-3", "epoch-2"]


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_with_any_stages_checkpoint(uninterrupted, tiny_data, tmp_path):
    """Without --resume, neither stage 01 over stage 05's sharded checkpoint nor 05 over 01's whole one (copies of
    the shared runs of conftest.py's `uninterrupted`)."""
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    shutil.copytree(uninterrupted("python", S01, "--epochs", 3), whole, symlinks=True)
    shutil.copytree(uninterrupted(2, S05, "--epochs", 1, "--save-model"), sharded, symlinks=True)
    for script, folder, found in ((S05, whole, "checkpoint.pt"), (S01, sharded, "checkpoint")):
        metrics = (folder / "metrics.csv").read_text()
        one_error(small(script, tiny_data, folder, "--epochs", 1), f"{folder / found} holds the checkpoint", "--resume")
        assert (folder / "metrics.csv").read_text() == metrics
    kind = "it holds checkpoint, of stage 05): resume it there, or export with --save-model"  # which, and the way
    one_error(small(S01, tiny_data, sharded, "--epochs", 2, "--resume"), f"no checkpoint.pt in {sharded}", kind)


@pytest.mark.slow
def test_a_checkpoint_that_is_not_a_regular_file_is_refused_before_it_is_opened(tiny_data, tmp_path):
    """A FIFO blocks torch.load for ever, where SIGTERM is only noted: neither the output folder's own checkpoint
    (a bare --resume, the automatic resume of a requeued job) nor the previous one is opened unless a file."""
    fifo = tmp_path / "checkpoint.pt"
    os.mkfifo(fifo)
    out = run([sys.executable, str(S01), *stage_args(tiny_data, tmp_path, "--resume")], timeout=30)
    one_error(out, f"{fifo} is not a regular file")
    fifo.unlink()
    fifo.write_bytes(b"damaged")
    os.mkfifo(tmp_path / resume.PREVIOUS)
    requeued = clean_env(SLURM_JOB_ID=77, SLURM_RESTART_COUNT=1)  # the job whose folder this is (its manifest)
    ownership.write(tmp_path, {"run": "r", "launch": ownership.launch({"SLURM_JOB_ID": "77"}), "writes": []})
    out = run([sys.executable, str(S01), *stage_args(tiny_data, tmp_path)], env=requeued, timeout=30)
    assert "is complete" not in one_error(
        out, f"{fifo} is not a checkpoint this code wrote, or is damaged", "delete it"
    )


@pytest.mark.slow
def test_a_resume_past_its_epochs_is_refused(uninterrupted, tiny_data, tmp_path):
    """A checkpoint of epoch 2 resumed with --epochs 1 printed "done" and exported the weights of more epochs than
    asked for, or of an epoch cut short: refused, naming both and the --epochs that continues it."""
    trained(uninterrupted, tmp_path, S01, "--limit", 64, "--epochs", 2)  # small()'s run, shared
    state = checkpoint(tmp_path)
    # as if saved one step into epoch 2: epoch 1's row and schedule step alone (recorded.check_values())
    part_way = {
        "step": 1,
        "log": {"rows": state["log"]["rows"][:1]},
        "scheduler": state["scheduler"] | {"last_epoch": 1},
    }
    torch.save(state | part_way, tmp_path / "checkpoint.pt")
    out = small(S01, tiny_data, tmp_path, "--epochs", 1, "--resume", "--save-model")
    one_error(out, "holds epoch 2, step 1, past --epochs 1: nothing to do; give --epochs 2 or more to continue it")
    assert not (tmp_path / "model.pt").exists()
    torch.save(state, tmp_path / "checkpoint.pt")  # the end of epoch 2: rank 0's verdict, in this process
    args, _ = cli.parse_args(stage_args(tiny_data, tmp_path, "--limit", 64, "--epochs", 1, "--resume"), [flags.add])
    with pytest.raises(SystemExit, match="holds epoch 2, past --epochs 1: nothing to do; give --epochs 3 or more"):
        resume.find(args, tmp_path / resume.WHOLE, resume.WHOLE, False, {"data": data_of(tmp_path)})
    args.epochs = 2  # the run is done: it says so, and --save-model exports it
    assert resume.find(args, tmp_path / resume.WHOLE, resume.WHOLE, False, {"data": data_of(tmp_path)})[0]["epoch"] == 2


def test_a_checkpoints_own_values_are_checked_before_anything_is_restored(tiny_data, tmp_path):
    """The checkpoint's values were trusted: int64 weights loaded into float ones (an optimizer's state too), an epoch of 0 printed "done: 3
    epochs" under --epochs 2, a step of -3 or 10^6 was blamed on a data set's __len__, a missing optimizer was a
    KeyError in the lesson. Each is one line naming what the checkpoint holds and what this run declares."""
    args, _ = cli.parse_args(stage_args(tiny_data, tmp_path, "--limit", 64, "--epochs", 3, "--resume"), [flags.add])
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters())
    log = metrics.Log(tmp_path, 1, metrics.Metric())
    states = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1), log=log)
    states["rng"] = randomness.Generators()
    model(torch.zeros(1, 1, 28, 28)).sum().backward()
    optimizer.step()  # a state for each parameter, of its shape
    for epoch in (1, 2):  # a row and a schedule step each
        log.rows.append({"epoch": epoch})
        states["scheduler"].step()
    lesson.save(tmp_path, 2, states)  # the end of epoch 2 of a run whose manifest records this run's options
    ownership.write(tmp_path, {"run": "r", "writes": [], "record": {"flags": preflight.defining(args), "data": "64-0"}})
    state, path = checkpoint(tmp_path), tmp_path / resume.WHOLE
    declared = recorded.declared(states, False, 64, args)  # 64 images, a batch of 64: one step an epoch
    as_ints = {k: v.to(torch.int64) if k == "fc2.bias" else v for k, v in state["model"].items()}
    without = {k: v for k, v in state["model"].items() if k != "fc2.bias"}
    groups = state["optimizer"]["param_groups"]
    for changed, said in [
        ({"model": as_ints}, "does not match this model: its fc2.bias is int64 of shape [10], the model's float32"),
        ({"model": without}, "does not match this model: its fc2.bias is missing"),
        ({"epoch": 0}, "holds epoch 0, which no run saves"),
        ({"epoch": "2"}, "holds epoch '2', which no run saves"),
        ({"step": -3}, "holds step -3 of epoch 2, where an epoch of this run has 1 steps"),
        ({"step": 10**6}, "holds step 1000000 of epoch 2, where an epoch of this run has 1 steps"),
        ({"optimizer": None}, "lacks its optimizer"),
        ({"optimizer": {"state": {}}}, "holds an optimizer state without its state and param_groups"),
        (
            {"optimizer": {"state": {0: {"square_avg": torch.zeros(3, dtype=torch.int64)}}, "param_groups": groups}},
            "holds the optimizer's square_avg of parameter 0 as int64 of shape [3], the parameter being of shape [32, 1",
        ),
        ({"optimizer": {"state": {}, "param_groups": groups[:0]}}, "holds the optimizer state of 0 parameters"),
        # a hand's edits: each was restored, then a KeyError, a wrong cause or a wrong number
        ({"log": {"rows": []}}, "holds metrics of epochs [] for 2 epochs done"),
        ({"step": 1}, "holds metrics of epochs [1, 2] for 1 epochs done"),  # a part-way checkpoint has one row
        ({"scheduler": state["scheduler"] | {"last_epoch": 3}}, "holds a schedule stepped 3 times for 2 epochs done"),
        (
            {"rng": {k: v for k, v in state["rng"].items() if k != "numpy"}},
            "holds random generators that cannot be put back",
        ),
        ({"rng": state["rng"] | {"cpu": torch.zeros(10, dtype=torch.uint8)}}, "holds random generators that cannot be"),
        (
            {"optimizer": state["optimizer"] | {"param_groups": [groups[0] | {"lr": "big"}]}},
            "holds the optimizer's lr 'big'",
        ),
        (
            {"optimizer": state["optimizer"] | {"param_groups": [groups[0] | {"lr": float("nan")}]}},
            "holds the optimizer's lr nan",
        ),
    ]:
        torch.save(state | changed, path)
        with pytest.raises(SystemExit, match=f"^error: {re.escape(str(path))} {re.escape(said)}"):
            resume.find(args, path, resume.WHOLE, False, {"data": "64-0"}, declared)
    missing = {k: v for k, v in state.items() if k != "optimizer"}
    torch.save(missing, path)
    with pytest.raises(SystemExit, match="lacks its optimizer"):
        resume.find(args, path, resume.WHOLE, False, {"data": "64-0"}, declared)
    torch.save(state, path)  # as the run wrote it: resumed
    assert resume.find(args, path, resume.WHOLE, False, {"data": "64-0"}, declared)[0]["epoch"] == 2


def test_a_sharded_checkpoints_dtypes_are_checked_before_anything_is_restored(tiny_data, tmp_path):
    """Stage 05's shards were left to DCP, which loads a float64 or int64 tensor listed under a float32 parameter's
    name into it, cast: an int64 weight resumed as its truncated values, exit 0. Rank 0 checks what .metadata
    lists against the model as it checks 01-04's checkpoint.pt (one check): one line naming the key and both dtypes
    (an optimizer's state, its parameter's), before any rank reads a shard."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from common import sharded

    args, _ = cli.parse_args(stage_args(tiny_data, tmp_path, "--limit", 64, "--epochs", 3, "--resume"), [flags.add])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))  # an int64 buffer too
    optimizer = torch.optim.Adadelta(model.parameters())
    states = dict(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # a state for each parameter, of its shape
    for _ in (1, 2):  # the end of epoch 2: stepped twice
        states["scheduler"].step()
    sharded.save(tmp_path, 2, states)  # stage 05 under a plain python: one process's shards, in epoch-2
    record = {"flags": preflight.defining(args), "data": "64-0"}
    ownership.write(tmp_path, {"run": "r", "writes": ["epoch-2"], "record": record})
    declared = recorded.declared(states, True, 64, args)
    path, folder = tmp_path / lesson.SHARDED, tmp_path / "epoch-2"
    weights, optimizer_state = get_state_dict(model, optimizer)
    square_avg = optimizer_state["state"]["0.weight"]["square_avg"]
    changes = [
        (
            {"1.bias": weights["1.bias"].double()},
            {},
            "its 1.bias is float64 of shape [3], the model's float32 of shape [3]",
        ),
        ({"0.weight": weights["0.weight"].long()}, {}, "its 0.weight is int64 of shape [3, 4], the model's float32"),
        (
            {"1.num_batches_tracked": weights["1.num_batches_tracked"].float()},
            {},
            "its 1.num_batches_tracked is float32 of shape [], the model's int64 of shape []",
        ),
        (
            {},
            {"square_avg": square_avg.long()},
            "holds the optimizer's square_avg of 0.weight as int64 of shape [3, 4], the model's 0.weight being float32",
        ),
        ({}, {"square_avg": square_avg[:2]}, "holds the optimizer's square_avg of 0.weight as float32 of shape [2, 4]"),
    ]
    for model_changed, state_changed, said in [*changes, ({}, {}, None)]:
        for shard in folder.glob("*.distcp"):
            shard.unlink()
        (folder / ".metadata").unlink()
        of_weight = optimizer_state["state"]["0.weight"] | state_changed
        saved = {"model": weights | model_changed, "optimizer": optimizer_state["state"] | {"0.weight": of_weight}}
        dcp.save(saved, checkpoint_id=folder)
        if said is None:  # as the run wrote it: resumed
            assert resume.find(args, path, lesson.SHARDED, False, {"data": "64-0"}, declared)[0]["epoch"] == 2
            continue
        with pytest.raises(SystemExit, match=f"^error: {re.escape(str(path))} .*{re.escape(said)}"):
            resume.find(args, path, lesson.SHARDED, False, {"data": "64-0"}, declared)


def data_of(folder):
    """The fingerprint of the training set the run in `folder` trained on, as its manifest records it."""
    return json.loads((folder / "run-manifest.json").read_text())["record"]["data"]


def test_the_previous_checkpoint_is_kept_where_hard_links_fail(tmp_path, monkeypatch):
    """Some FUSE filesystems refuse hard links: the previous checkpoint is then a copy, switched in alike."""
    latest, previous = tmp_path / "checkpoint.pt", tmp_path / resume.PREVIOUS
    for epoch in (1, 2):
        saving.keep_previous(tmp_path)
        with lesson.atomic(latest) as f:
            torch.save({"epoch": epoch}, f)
        monkeypatch.setattr(saving.os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no links")))
    assert torch.load(previous)["epoch"] == 1 and torch.load(latest)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-previous.pt", "checkpoint.pt"]


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_under_torchrun(uninterrupted, tiny_data, tmp_path):
    whole = uninterrupted(2, S03, "--epochs", 3)  # conftest.py: shared with test_resume_restores_everything
    killed = tmp_path / "killed"
    kill_rank_1_after_a_checkpoint(S03, stage_args(tiny_data, killed, "--epochs", 3), killed / "checkpoint.pt")
    assert_same_state(checkpoint(killed)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
def test_interrupted_run_resumes_with_flag(uninterrupted, tiny_data, tmp_path):
    whole = uninterrupted("python", S01, "--epochs", 3)  # shared with test_resume_restores_everything
    cut = tmp_path / "cut"
    proc = start(S01, *stage_args(tiny_data, cut, "--epochs", 3))
    wait_for((cut / "checkpoint.pt").exists, proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert python(S01, *stage_args(tiny_data, cut, "--epochs", 3)).returncode != 0  # no silent restart...
    resumed = python(S01, *stage_args(tiny_data, cut, "--epochs", 3, "--resume"))  # ...only on request
    assert resumed.returncode == 0 and "resumed after epoch" in resumed.stdout
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


# 3: resume restores only part of the state
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_resume_restores_everything(launch, uninterrupted, tiny_data, tmp_path):
    def train(folder, epochs, *extra):
        args = stage_args(tiny_data, folder, "--epochs", epochs, *extra)
        out = python(S01, *args) if launch == "python" else torchrun(2, S03, *args)
        assert out.returncode == 0, out.stderr
        return out.stdout

    # conftest.py: the uninterrupted run, shared with the tests that kill it
    whole = uninterrupted(*(("python", S01) if launch == "python" else (2, S03)), "--epochs", 3)
    if launch == "python":
        trained(uninterrupted, tmp_path / "parts", S01, "--epochs", 1)  # the run of one epoch, shared
    else:  # a copy of the run of one epoch at 2 ranks, shared (conftest.py): --save-model is a free option, which
        # exports model.pt at the end and changes nothing the checkpoint holds
        shutil.copytree(uninterrupted(2, S03, "--epochs", 1, "--save-model"), tmp_path / "parts", symlinks=True)
    assert "resumed after epoch 1" in train(tmp_path / "parts", 3, "--resume")
    assert_same_state(checkpoint(tmp_path / "parts"), checkpoint(whole))
    finished = train(tmp_path / "parts", 3, "--resume")  # all epochs done: report and exit 0
    assert "epoch " not in finished.replace("resumed after epoch", "") and "done: 3 epochs" in finished


# 7: every rank writes the checkpoint; a crash mid-write corrupts it
@pytest.mark.slow
def test_one_writer_and_resume_without_shared_filesystem(tiny_data, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]  # two working folders: nodes sharing no disk
    for node in nodes:
        node.mkdir()
    for epochs, extra in ((1, ()), (2, ("--resume",))):
        out = "/proc/self/cwd/out"  # one path on every node, a folder of each node's own (its working folder)
        args = ("--data-dir", tiny_data, "--output-dir", out, "--num-workers", 0, "--epochs", epochs, *extra)
        codes, outputs = srun_like(2, S04, *args, cwds=nodes)
        assert codes == [0, 0], outputs
    assert checkpoint(nodes[0] / "out")["epoch"] == 2 and not (nodes[1] / "out").exists()
    assert "resumed after epoch 1" in outputs[0]  # rank 1 resumed too: from rank 0's broadcast


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_data, tmp_path):
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 3), PYTHONPATH=INJECT, FAULT_RANK=0, FAULT_SAVE=2)
    assert out.returncode == -signal.SIGKILL
    assert checkpoint(tmp_path)["epoch"] == 1  # the second write died half-way; the first is intact
    resumed = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 3, "--resume"))
    assert resumed.returncode == 0 and checkpoint(tmp_path)["epoch"] == 3


# 8: torch.load of a pickle runs arbitrary code
class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_crafted_checkpoint_is_refused_and_runs_nothing(tiny_data, tmp_path):
    payload = Payload()
    payload.marker = tmp_path / "pwned"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"model": payload}, f)
    out = python(S01, *stage_args(tiny_data, tmp_path / "out", "--resume", tmp_path / "evil.pt"))
    one_error(out, f"{tmp_path / 'evil.pt'} is not a checkpoint this repository wrote", "it may be planted; delete it")
    assert not payload.marker.exists()


class Wrapping:
    """A pickle that runs `payload`, then gives back `real`, the file's own contents: unpickled as torch
    unpickles a sharded checkpoint's .metadata, the resume would go on, exit 0 and leave no trace."""

    def __init__(self, payload, real):
        self.payload, self.real = payload, real

    def __reduce__(self):
        return (operator.itemgetter(1), ((self.payload, self.real),))


def plant(folder, kind, marker):
    """Make one file of the sharded checkpoint `folder` touch `marker` when torch loads it, and return it:
    `.metadata` as a plain payload ("metadata"), or wrapping the real one ("wrapping"); the real one with
    model.fc2.bias moved to a payload appended to a shard, listed as an item DCP unpickles ("bytes item",
    BytesStorageMetadata) or still as a tensor ("tensor item": the shard is the planted file); state.pt."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    payload = Payload()
    payload.marker = marker
    if kind == "state.pt":
        torch.save({"epoch": payload, "flags": {}}, folder / "state.pt")
        return folder / "state.pt"
    index, shard, item = folder / ".metadata", folder / "__0_0.distcp", io.BytesIO()
    real = pickle.loads(index.read_bytes())  # written by the test's own run: trusted
    if kind in ("bytes item", "tensor item"):
        torch.save(payload, item)
        at = _StorageInfo(shard.name, shard.stat().st_size, len(item.getvalue()))
        with open(shard, "ab") as f:
            f.write(item.getvalue())
        pieces = [key for key in real.storage_data if key.fqn == "model.fc2.bias"]  # one per rank that saved it
        real.storage_data.update({key: at for key in pieces})
    if kind == "bytes item":
        real.state_dict_metadata["model.fc2.bias"] = BytesStorageMetadata()
        for key in pieces:
            del real.storage_data[key]
        real.storage_data[MetadataIndex("model.fc2.bias")] = at
    contents = {"metadata": payload, "wrapping": Wrapping(payload, real)}.get(kind, real)
    index.write_bytes(pickle.dumps(contents))
    return shard if kind == "tensor item" else index


def test_a_sharded_checkpoints_metadata_is_read_running_nothing(tmp_path):
    """shards.index (the lesson's reader) and safeload.metadata (damage(), rank 0's check) read .metadata: builds DCP's metadata and refuses anything
    else, naming the file: a planted .metadata runs nothing, whether it would fail or wrap the real one, and
    neither does one listing an item that DCP unpickles. A shard's tensor is read by torch.load(weights_only=
    True): a pickle there is refused, in words that do not advise weights_only=False."""
    from torch.distributed import checkpoint as dcp

    weights, marker = Net().state_dict(), tmp_path / "pwned"
    dcp.save({"model": weights}, checkpoint_id=tmp_path / "ours")  # no process group: this process's shards
    assert safeload.damage(tmp_path / "ours") is None
    loaded = {"model": {name: torch.zeros_like(w) for name, w in weights.items()}}
    dcp.load(loaded, storage_reader=shards.reader(tmp_path / "ours"))
    assert_same_state(loaded["model"], weights)
    call = ", which loading would call"
    for kind, names in (("metadata", "posix.system" + call), ("wrapping", "operator.itemgetter" + call),
                        ("bytes item", "an item torch would unpickle"), ("tensor item", None)):  # fmt: skip
        shutil.copytree(tmp_path / "ours", tmp_path / kind)
        planted = plant(tmp_path / kind, kind, marker)
        with pytest.raises(dcp.CheckpointException) as refused:
            dcp.load(loaded, storage_reader=shards.reader(tmp_path / kind))
        if names is None:  # the metadata is DCP's own
            assert safeload.damage(tmp_path / kind) is None
            assert safeload.describe(refused.value) == (
                "rank 0: a shard holds a pickle that torch.load(weights_only=True) refuses: it may be planted"
            )
            continue
        message = f"{planted} is not a checkpoint this repository wrote (it names {names}): it may be planted"
        assert message in str(refused.value)
        for read in (safeload.damage, safeload.metadata):
            with pytest.raises(shards.Planted, match=re.escape(message)):
                read(tmp_path / kind)
    assert not marker.exists()


@pytest.mark.slow
def test_a_planted_sharded_checkpoint_is_refused_and_runs_nothing(uninterrupted, tiny_data, tmp_path):
    """Each kind of plant() in stage 05's latest checkpoint: one line naming the file, the complete checkpoint
    before it to resume from, and nothing run (a shard's tensor: the folder, in the load). That one then
    resumes with no unrestricted unpickling at all (tests/inject NO_UNPICKLE: pickle.load(s) and
    torch.load(weights_only=False) raise)."""
    out, marker = tmp_path / "out", tmp_path / "pwned"
    trained(uninterrupted, out, S05, "--limit", 64, "--epochs", 2)  # the run of 2 epochs, shared
    shutil.copytree(out / "epoch-2", tmp_path / "kept")
    for kind in ("metadata", "wrapping", "bytes item", "state.pt", "tensor item"):
        shutil.rmtree(out / "epoch-2")
        shutil.copytree(tmp_path / "kept", out / "epoch-2")
        planted = plant(out / "epoch-2", kind, marker)
        refused = python(S05, *stage_args(tiny_data, out, "--limit", 64, "--epochs", 3, "--resume"))
        if kind == "tensor item":
            one_error(refused, f"error: cannot load the checkpoint {planted.parent.resolve()}: rank 0: a shard holds a "
                      "pickle that torch.load(weights_only=True) refuses: it may be planted: resume from a complete one")  # fmt: skip
        else:
            one_error(refused, f"error: {planted} is not a checkpoint this repository wrote (", "): it may be planted; "
                      f"delete it or resume from another checkpoint: the checkpoint of epoch 1 is complete: resume "
                      f"from it with --resume {out / 'epoch-1'}")  # fmt: skip
        assert not marker.exists(), kind
    args = stage_args(tiny_data, out, "--limit", 64, "--epochs", 3, "--resume", out / "epoch-1")
    resumed = python(S05, *args, PYTHONPATH=f"{INJECT}:{REPO}", NO_UNPICKLE=1)
    assert resumed.returncode == 0 and "resumed after epoch 1" in resumed.stdout, resumed.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_a_requeued_stage05_refuses_a_planted_checkpoint_by_itself(tiny_data, tmp_path):
    """A requeued job resumes without --resume: a .metadata wrapping the real one, planted in its folder, is
    refused on both ranks before either reads it; rank 0 says so in one line, and nothing runs."""
    job, out, marker = free_job_id(), tmp_path / "out", tmp_path / "pwned"
    codes, outputs = srun_like(2, S05, *stage_args(tiny_data, out, "--limit", 64, "--epochs", 1), job_id=job)
    assert codes == [0, 0], outputs
    planted = plant(out / "epoch-1", "wrapping", marker)
    args = stage_args(tiny_data, out, "--limit", 64, "--epochs", 2)
    codes, outputs = srun_like(2, S05, *args, job_id=job, SLURM_RESTART_COUNT=1)
    errors = [line for output in outputs for line in output.splitlines() if line.startswith("error:")]
    assert codes[0] != 0 and codes[1] != 0 and not marker.exists(), outputs
    assert errors == [f"error: {planted} is not a checkpoint this repository wrote (it names operator.itemgetter, "
                      "which loading would call): it may be planted; delete it or resume from another checkpoint"]  # fmt: skip
    assert "Traceback" not in "".join(outputs), outputs


@pytest.mark.slow
def test_every_torch_load_is_weights_only():
    for path in REPO.glob("[0c]*/**/*.py"):
        for line in path.read_text().splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line}"


# 12: a DDP checkpoint does not load into the single-GPU model
@pytest.mark.slow
def test_checkpoints_move_between_stages(uninterrupted, tiny_data, tmp_path):
    ddp_run = uninterrupted(2, S03, "--epochs", 1, "--save-model")  # conftest.py: test_fsdp.py's stage 03 run too
    net = Net()
    net.load_state_dict(checkpoint(ddp_run)["model"], strict=True)
    ddp = torch.nn.parallel.DistributedDataParallel  # the saved keys are the wrapped module's, unprefixed
    assert not any(k.startswith("module.") for k in checkpoint(ddp_run)["model"]) and ddp
    x = torch.randn(4, 1, 28, 28)
    again = Net()
    again.load_state_dict(checkpoint(ddp_run)["model"])
    torch.testing.assert_close(net.eval()(x), again.eval()(x), rtol=0, atol=0)
    single = python(S01, *stage_args(tiny_data, tmp_path / "one", "--epochs", 2, "--resume", ddp_run / "checkpoint.pt"))
    assert single.returncode == 0 and "resumed after epoch 1" in single.stdout, single.stderr
    back = torchrun(
        2, S03, *stage_args(tiny_data, tmp_path / "two", "--epochs", 3, "--resume", tmp_path / "one/checkpoint.pt")
    )
    assert back.returncode == 0 and "resumed after epoch 2" in back.stdout, back.stderr


@pytest.mark.slow
def test_a_resume_at_another_world_size_says_so_before_its_first_step(uninterrupted, tiny_data, tmp_path):
    """Stage 03 saved at 2 ranks and resumed at 1 exited 0, its weights 0.032 from those of a run that stayed at 1,
    without a word. It trains the same samples (the global batch is the same) but each rank draws its own dropout
    masks: one line says so before the first step of the resumed run, and its weights are another run's."""
    # a copy of the run of one epoch at 2 ranks, shared (conftest.py); --save-model, a free option, exported its
    # model, which the resumed run must write anew
    shutil.copytree(uninterrupted(2, S03, "--epochs", 1, "--save-model"), tmp_path / "resized", symlinks=True)
    (tmp_path / "resized" / "model.pt").unlink()
    resumed = python(S03, *stage_args(tiny_data, tmp_path / "resized", "--epochs", 2, "--resume", "--save-model"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    said = lines.index("resumed at world size 1 from 2: the same samples, not bit-identical")
    assert said < next(i for i, line in enumerate(lines) if line.strip().startswith("epoch 2 batch 0"))
    stayed = python(S03, *stage_args(tiny_data, tmp_path / "stayed", "--epochs", 2, "--save-model"))
    assert stayed.returncode == 0 and "world size" not in stayed.stdout.split("rank 0 |")[-1], stayed.stdout
    resized, one = checkpoint(tmp_path / "resized", "model.pt"), checkpoint(tmp_path / "stayed", "model.pt")
    apart = max((resized[k] - one[k]).abs().max().item() for k in one)
    print(f"resized 2 -> 1 against a run at 1: {apart:.3g}")  # tests/FAILURES.md quotes it
    assert apart > 0


# a checkpoint that does not match the model or the flags
@pytest.mark.slow
def test_mismatched_checkpoint_is_an_error_that_says_so(uninterrupted, tiny_data, tmp_path):
    run = tmp_path / "run"  # its folder holds no other run's: "x" beside it, not inside it (ownership)
    trained(uninterrupted, run, S01, "--epochs", 1)  # the run of one epoch, shared
    out = python(S01, *stage_args(tiny_data, run, "--epochs", 2, "--lr", 0.5, "--resume"))
    assert out.returncode != 0 and "--lr 1.0" in out.stderr
    state = checkpoint(run)
    state["model"]["fc2.weight"] = torch.zeros(5, 128)
    torch.save(state, run / "other.pt")
    out = python(S01, *stage_args(tiny_data, tmp_path / "x", "--epochs", 2, "--resume", run / "other.pt"))
    assert out.returncode != 0 and "does not match this model" in out.stderr
