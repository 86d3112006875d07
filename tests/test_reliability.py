"""The failure modes of ../RELIABILITY.md, one test (or more) per row, on CPUs with gloo.

Faults come from outside train.py: signals, and tests/inject/sitecustomize.py on PYTHONPATH.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from helpers import (
    REPO,
    TRAIN_SIZE,
    clean_env,
    processes_with,
    run,
    srun_like,
    stage_args,
    torchrun,
    torchrun_cmd,
)  # fmt: skip

from common.models import Net

pytestmark = pytest.mark.slow
S01, S03, S04 = (REPO / s / "train.py" for s in ("01_single_gpu", "03_ddp_single_node", "04_ddp_multi_node"))
INJECT = str(REPO / "tests" / "inject")
TIMING = {"epoch_seconds", "images_per_s", "images_per_s_per_process"}  # the only fields a resume may change


def python(script, *args, **env):
    return run([sys.executable, str(script), *map(str, args)], env=clean_env(**env))


def checkpoint(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)


def assert_same_state(a, b, path="checkpoint"):
    """Field by field: model, optimizer, scheduler, epoch, RNG and the metrics (times excepted)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a.keys() - TIMING:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def wait_for(condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# 1: one rank raises; the others must not block in a collective forever
@pytest.mark.parametrize("launch", ["torchrun", "srun"])
def test_one_failing_rank_ends_the_run(launch, tiny_data, tmp_path):
    marker = f"TEST_RUN={uuid.uuid4()}"
    env = dict(PYTHONPATH=INJECT, FAULT_RANK=1, FAULT_STEP=3, TEST_RUN=marker.split("=")[1])
    start = time.monotonic()
    if launch == "torchrun":
        out = run(torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 3)), env=clean_env(**env))
        codes, output = [out.returncode], out.stdout + out.stderr
    else:
        codes, outputs = srun_like(2, S04, *stage_args(tiny_data, tmp_path, "--epochs", 3), **env)
        output = "".join(outputs)
    assert all(codes) and time.monotonic() - start < 60, output
    assert "injected fault: rank 1 at step 3" in output
    wait_for(lambda: not processes_with(marker), timeout=5)


# 2: a killed job loses its progress
def kill_rank_1_after_a_checkpoint(script, args, checkpoint):
    """torchrun with one restart; once `checkpoint` exists, SIGKILL rank 1: the run must restart and finish."""
    marker = f"TEST_RUN={uuid.uuid4()}"
    env = clean_env(TEST_RUN=marker.split("=")[1], TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)  # as the job scripts
    proc = subprocess.Popen(
        torchrun_cmd(2, script, *args, restarts=1), env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    wait_for(checkpoint.exists)
    rank1 = [
        pid for pid in processes_with(marker) if b"RANK=1" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    ]
    os.kill(rank1[0], signal.SIGKILL)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "torchrun restart 1" in output, output


def test_killed_rank_restarts_and_resumes_under_torchrun(tiny_data, tmp_path):
    args = stage_args(tiny_data, tmp_path / "whole", "--epochs", 3)
    assert torchrun(2, S03, *args).returncode == 0
    killed = tmp_path / "killed"
    kill_rank_1_after_a_checkpoint(S03, stage_args(tiny_data, killed, "--epochs", 3), killed / "checkpoint.pt")
    assert_same_state(checkpoint(killed)["model"], checkpoint(tmp_path / "whole")["model"])


def test_interrupted_run_resumes_with_flag(tiny_data, tmp_path):
    assert python(S01, *stage_args(tiny_data, tmp_path / "whole", "--epochs", 3)).returncode == 0
    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [sys.executable, str(S01), *stage_args(tiny_data, cut, "--epochs", 3)], env=clean_env(), cwd=REPO
    )
    wait_for(lambda: (cut / "checkpoint.pt").exists())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert python(S01, *stage_args(tiny_data, cut, "--epochs", 3)).returncode != 0  # no silent restart...
    resumed = python(S01, *stage_args(tiny_data, cut, "--epochs", 3, "--resume"))  # ...only on request
    assert resumed.returncode == 0 and "resumed after epoch" in resumed.stdout
    assert_same_state(checkpoint(cut)["model"], checkpoint(tmp_path / "whole")["model"])


# 3: resume restores only part of the state
@pytest.mark.parametrize("launch", ["python", "torchrun"])
def test_resume_restores_everything(launch, tiny_data, tmp_path):
    def train(folder, epochs, *extra):
        args = stage_args(tiny_data, folder, "--epochs", epochs, *extra)
        out = python(S01, *args) if launch == "python" else torchrun(2, S03, *args)
        assert out.returncode == 0, out.stderr
        return out.stdout

    train(tmp_path / "whole", 3)
    train(tmp_path / "parts", 1)
    assert "resumed after epoch 1" in train(tmp_path / "parts", 3, "--resume")
    assert_same_state(checkpoint(tmp_path / "parts"), checkpoint(tmp_path / "whole"))
    finished = train(tmp_path / "parts", 3, "--resume")  # all epochs done: report and exit 0
    assert "epoch " not in finished.replace("resumed after epoch", "") and "done: 3 epochs" in finished


# 7: every rank writes the checkpoint; a crash mid-write corrupts it
def test_one_writer_and_resume_without_shared_filesystem(tiny_data, tmp_path):
    nodes = [tmp_path / "node0", tmp_path / "node1"]  # two working folders: nodes sharing no disk
    for node in nodes:
        node.mkdir()
    for epochs, extra in ((1, ()), (2, ("--resume",))):
        args = ("--data-dir", tiny_data, "--output-dir", "out", "--num-workers", 0, "--epochs", epochs, *extra)
        codes, outputs = srun_like(2, S04, *args, cwds=nodes)
        assert codes == [0, 0], outputs
    assert checkpoint(nodes[0] / "out")["epoch"] == 2 and not (nodes[1] / "out").exists()
    assert "resumed after epoch 1" in outputs[0]  # rank 1 resumed too: from rank 0's broadcast


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


def test_crafted_checkpoint_is_refused_and_runs_nothing(tiny_data, tmp_path):
    payload = Payload()
    payload.marker = tmp_path / "pwned"
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"model": payload}, f)
    out = python(S01, *stage_args(tiny_data, tmp_path / "out", "--resume", tmp_path / "evil.pt"))
    assert out.returncode != 0 and "is not a checkpoint" in out.stderr
    assert not payload.marker.exists()


def test_every_torch_load_is_weights_only():
    for path in REPO.glob("[0c]*/**/*.py"):
        for line in path.read_text().splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path}: {line}"


# 9: every rank downloads / compute node offline
def test_missing_data_fails_every_rank_fast(tmp_path):
    start = time.monotonic()
    out = torchrun(2, S03, *stage_args(tmp_path / "empty", tmp_path))
    assert out.returncode != 0 and time.monotonic() - start < 30
    assert out.stderr.count("make data") >= 2  # each rank says why, and what to do


# 10: two jobs on one node pick the same MASTER_PORT
def test_two_jobs_on_one_node_run_side_by_side(tiny_data, tmp_path):
    jobs = []
    for job_id in (3001, 3002):
        args = stage_args(tiny_data, tmp_path / str(job_id), "--epochs", 1)
        jobs.append(subprocess.Popen(
            [sys.executable, "-c", "import helpers, sys; sys.exit(max(helpers.srun_like(2, *sys.argv[2:], job_id=sys.argv[1])[0]))",
             str(job_id), str(S04), *map(str, args)],
            cwd=REPO / "tests", env=clean_env(),
        ))  # fmt: skip
    assert [job.wait(timeout=120) for job in jobs] == [0, 0]


# 11: forgetting sampler.set_epoch
def test_each_epoch_reshuffles_and_covers_the_data_once(tiny_data, tmp_path):
    record = tmp_path / "samples.jsonl"
    out = run(torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 2)),
              env=clean_env(PYTHONPATH=INJECT, RECORD_SAMPLES=record))  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    by_epoch = {e: [s for s in seen if s["epoch"] == e] for e in (1, 2)}
    for shards in by_epoch.values():
        assert sorted(sum((s["indices"] for s in shards), [])) == list(range(TRAIN_SIZE))
    order = {e: {s["rank"]: s["indices"] for s in shards} for e, shards in by_epoch.items()}
    assert order[1][0] != order[2][0]


# 12: a DDP checkpoint does not load into the single-GPU model
def test_checkpoints_move_between_stages(tiny_data, tmp_path):
    assert torchrun(2, S03, *stage_args(tiny_data, tmp_path / "ddp", "--epochs", 1)).returncode == 0
    net = Net()
    net.load_state_dict(checkpoint(tmp_path / "ddp")["model"], strict=True)
    ddp = torch.nn.parallel.DistributedDataParallel  # the saved keys are the wrapped module's, unprefixed
    assert not any(k.startswith("module.") for k in checkpoint(tmp_path / "ddp")["model"]) and ddp
    x = torch.randn(4, 1, 28, 28)
    again = Net()
    again.load_state_dict(checkpoint(tmp_path / "ddp")["model"])
    torch.testing.assert_close(net.eval()(x), again.eval()(x), rtol=0, atol=0)
    single = python(
        S01, *stage_args(tiny_data, tmp_path / "one", "--epochs", 2, "--resume", tmp_path / "ddp/checkpoint.pt")
    )
    assert single.returncode == 0 and "resumed after epoch 1" in single.stdout, single.stderr
    back = torchrun(
        2, S03, *stage_args(tiny_data, tmp_path / "two", "--epochs", 3, "--resume", tmp_path / "one/checkpoint.pt")
    )
    assert back.returncode == 0 and "resumed after epoch 2" in back.stdout, back.stderr


# 14: batch size not divisible by the world size, zero or negative values
@pytest.mark.parametrize("flag, message", [(("--batch-size", 64), "--batch-size 64"), (("--epochs", 0), "--epochs")])
def test_bad_numbers_fail_before_any_process_group(flag, message, tiny_data, tmp_path):
    start = time.monotonic()
    out = torchrun(3, S03, *stage_args(tiny_data, tmp_path, *flag))
    assert out.returncode != 0 and message in out.stderr and time.monotonic() - start < 30
    assert "init_process_group" not in out.stderr


# a checkpoint that does not match the model or the flags
def test_mismatched_checkpoint_is_an_error_that_says_so(tiny_data, tmp_path):
    assert python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1)).returncode == 0
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2, "--lr", 0.5, "--resume"))
    assert out.returncode != 0 and "--lr 1.0" in out.stderr
    state = checkpoint(tmp_path)
    state["model"]["fc2.weight"] = torch.zeros(5, 128)
    torch.save(state, tmp_path / "other.pt")
    out = python(S01, *stage_args(tiny_data, tmp_path / "x", "--epochs", 2, "--resume", tmp_path / "other.pt"))
    assert out.returncode != 0 and "does not match this model" in out.stderr
