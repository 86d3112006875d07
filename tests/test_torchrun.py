"""torchrun's ends, clean: a run that succeeds ends its log with its summary, a usage error ends the job in
one line before torchrun starts (and restarts) workers. The job scripts run under bash with a fake srun
(it runs its command here) and scontrol; a rank slow to exit, as a GPU rank tearing down CUDA is, once
made the ranks' heartbeats hit rank 0's closed store: a C++ stack trace per rank after the summary."""

import os
import re
import signal
import time

import pytest
from helpers import (
    INJECT,
    REPO,
    S04,
    clean_env,
    free_job_id,
    nodes,
    rank_pid,
    run,
    stage_args,
    wait_for,
)

pytestmark = pytest.mark.slow
SLOW_EXIT = "import atexit, os, time\nif os.environ.get('RANK', '0') != '0':\n    atexit.register(time.sleep, 4)\n"


def job_env(tmp_path, job_id=4242):
    """What Slurm gives a one-node batch script with 2 GPUs; srun and scontrol from tmp_path/bin."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "srun").write_text('#!/bin/bash\ntouch "$SRUN_RAN"\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bin_ / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_ / tool).chmod(0o755)
    (tmp_path / "sitecustomize.py").write_text(SLOW_EXIT)
    return clean_env(
        PATH=f"{bin_}:{clean_env()['PATH']}", PYTHONPATH=f"{tmp_path}:{REPO}", SRUN_RAN=tmp_path / "srun-ran",
        SLURM_JOB_ID=job_id, SLURM_JOB_NAME="test", SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES=1,
        SLURM_GPUS_ON_NODE=2, SLURM_CPUS_PER_TASK=2,
    )  # fmt: skip


def job(script, tmp_path, *args, job_id=4242):
    env = job_env(tmp_path, job_id) | {"SLURM_SUBMIT_DIR": str((REPO / script).parent)}
    start = time.monotonic()
    out = run(["bash", str(REPO / script), *map(str, args)], env=env, timeout=120, cwd=(REPO / script).parent)
    return out, time.monotonic() - start


def test_job_script_run_ends_with_its_summary(tiny_data, tmp_path):
    out, seconds = job("04_ddp_multi_node/job_torchrun.slurm", tmp_path, *stage_args(tiny_data, tmp_path / "o", "--epochs", 1),
                       job_id=free_job_id())  # fmt: skip
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 0 and lines[-1].startswith("done: 1 epochs"), out.stdout + out.stderr
    assert not out.stderr.strip() and seconds < 60, (out.stderr, seconds)


# torchrun's own race, now and then (pytorch/pytorch#69197): the agent serving the c10d rendezvous store ends
# first, and the other agent, closing the rendezvous, warns from C++ (its frames) and from Python.
RACE = re.compile(
    r"\[W\d{4} .*\[c10d\] |Exception raised from |frame #\d+: |<omitting python frames>|.* has failed to shutdown the rendezvous "
)


def without_torchruns_race(output):
    """The output of an agent without the lines of torchrun's race; any other line stays."""
    if " has failed to shutdown the rendezvous " not in output:
        return output
    return "".join(line for line in output.splitlines(keepends=True) if line.strip() and not RACE.match(line))


def test_two_torchruns_end_with_the_summary(tiny_data, tmp_path):
    """Two torchruns meeting in a c10d rendezvous, as on two nodes: nothing from either after the summary."""
    start = time.monotonic()
    agents = nodes(S04, *stage_args(tiny_data, tmp_path / "o", "--epochs", 1), restarts=1, env=job_env(tmp_path))
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    seconds = time.monotonic() - start
    assert [agent.returncode for agent in agents] == [0, 0] and seconds < 60, outputs
    quiet, summary = sorted(outputs, key=lambda output: "done:" in output)  # rank 0's agent prints the run
    summary, quiet = map(without_torchruns_race, (summary, quiet))
    assert summary.strip().splitlines()[-1].startswith("done: 1 epochs") and quiet == "", outputs


@pytest.mark.parametrize("script", ["04_ddp_multi_node/job_torchrun.slurm", "03_ddp_single_node/job.slurm"])
def test_usage_error_ends_the_job_before_torchrun(script, tmp_path):
    out, seconds = job(script, tmp_path, "--lr", "nan")
    assert out.returncode == 2 and seconds < 15, (out, seconds)
    assert (out.stdout + out.stderr).splitlines() == [
        "error: argument --lr: must be a number in (0, 3.4e38], got nan (see --help)"
    ]
    assert not (tmp_path / "srun-ran").exists()  # torchrun never started


def test_a_restart_torch_does_not_count_still_resumes(tiny_data, tmp_path):
    """Two torchruns as on two nodes; rank 1 is killed. Its torchrun counts a restart; rank 0's, whose worker
    was still busy (slow here), restarts it "for a new node" and counts none (torch 2.14). The ranks must
    still meet again, and resume, rather than wait out --dist-timeout under two restart counts."""
    env = clean_env(PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_SLEEP=1.5, RUN_MARKER=tmp_path.name)
    agents = nodes(
        S04, *stage_args(tiny_data, tmp_path / "o", "--epochs", 2, "--dist-timeout", 60), restarts=1, env=env
    )
    wait_for((tmp_path / "o" / "checkpoint.pt").exists, proc=agents[0])
    start = time.monotonic()
    os.kill(rank_pid(f"RUN_MARKER={tmp_path.name}", 1), signal.SIGKILL)
    outputs = [agent.communicate(timeout=180)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert "resumed after epoch " in "".join(outputs) and time.monotonic() - start < 60


def test_torchruns_on_two_nodes_sharing_their_store_across_restarts_are_refused_at_once(tiny_data, tmp_path):
    """torchrun shares its rendezvous store with the workers by default, and each node counts its restarts: after a
    worker of one node was killed, its node's attempt 1 met the other node's attempt 0 again, in keys the first
    attempt left, and both ended "another task has RANK 0 too" (a cause that was not there): the run was lost. With
    --max-restarts on several nodes, the shared store is refused before the first step, naming the variable."""
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="0")
    agents = nodes(S04, *stage_args(tiny_data, tmp_path / "o", "--epochs", 1), restarts=1, env=env)
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [1, 1], outputs
    errors = [line for line in "".join(outputs).splitlines() if line.startswith("error:")]
    assert errors and all("export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun" in e for e in errors), errors
    assert not (tmp_path / "o" / "metrics.csv").exists()
