"""Every process ends, and a failure on one side is one line on every side: a task's thread neither keeps a run nor a
tool alive past its verdict, nor fails it silently; a signal after the verdict ends it; a rank refused at start-up,
or launched unlike its peers, is named by the others before any wait. What each test proves is in tests/FAILURES.md."""

import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, S01, S03, clean_env, free_port, one_error, python, stage_args, wait_for

from common.guards import ending

TASK = "import atexit, threading, time\nfrom common.tasks.sequences import *\nfrom common.tasks import sequences as base\n"
SLEEPER = TASK + "def model(args):\n    threading.Thread(target=time.sleep, args=(3600,)).start()\n    return base.model(args)\n"
RAISER = TASK + (
    "def broken():\n    raise ValueError('the prefetcher broke')\n"  # line 5: the thread's raise
    "def model(args):\n    threading.Thread(target=broken, name='prefetch').start()\n    time.sleep(1)\n"
    "    return base.model(args)\n"
)
LATE = TASK + "def model(args):\n    atexit.register(time.sleep, 3600)\n    return base.model(args)\n"


def task(tmp_path, source):
    path = tmp_path / "my_task.py"
    path.write_text(source)
    return path


def test_a_thread_a_task_left_running_does_not_keep_the_run(tmp_path):
    """The task starts a thread that is no daemon: the run printed its last epoch and never ended (Python's teardown
    waits for the thread), holding its GPUs until the job's time limit. It ends with its status."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, SLEEPER), "--epochs", 1)
    out = python(S01, *args, timeout=90)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.seconds < 60


def test_an_error_in_a_tasks_thread_is_one_line_and_fails_the_run(tmp_path):
    """Python printed the thread's traceback and the run went on to end 0; now one line naming the thread, the error
    and its place in the task, status 1."""
    path = task(tmp_path, RAISER)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", path, "--epochs", 1), timeout=90)
    assert out.returncode == 1, out.stderr[-2000:]
    one_error(out, "in thread prefetch", "ValueError: the prefetcher broke", f"{path}:5")


def test_a_signal_after_the_verdict_ends_the_run_with_its_status(tmp_path):
    """After the verdict the stops were ignored (SIG_IGN): a run that something still held (here an exit function of
    the task's that never returns) stayed until the time limit, deaf to scancel. A stop now ends it, status kept."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, LATE), "--epochs", 1)
    proc = subprocess.Popen([sys.executable, str(S01), *args], env=clean_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wait_for(lambda: (tmp_path / "out" / "metrics.csv").exists() and (tmp_path / "out" / "checkpoint.pt").exists(),
             90, proc)  # fmt: skip
    time.sleep(3)  # the run's end: its last line, then the task's exit function
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0, proc.stdout.read()[-2000:]


def test_a_tool_ends_though_a_task_left_a_thread_running(tmp_path):
    """tools/plan.py with such a task printed its plan and never ended."""
    plan = [sys.executable, str(REPO / "tools/plan.py"), "--task", task(tmp_path, SLEEPER), "--batch-size", "8"]
    out = subprocess.run(plan, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_the_end_names_the_threads_it_does_not_wait_for():
    """ending.lingering(): the threads Python's teardown would wait for, and no daemon."""
    import threading

    stop = threading.Event()
    kept, daemon = threading.Thread(target=stop.wait, name="kept"), threading.Thread(target=stop.wait, daemon=True)
    kept.start(), daemon.start()
    try:
        assert ending.lingering() == ["kept"]
    finally:
        stop.set()
    kept.join()
    assert ending.lingering() == []


def launch(world_sizes, args, job_ids=None, procids=None, **extra):
    """srun's tasks of one step, each with its own SLURM_NTASKS (and job id, and SLURM_PROCID where given): one
    launched by hand beside the others, or by another job."""
    port, procs = free_port(), []
    for rank, world_size in enumerate(world_sizes):
        env = clean_env(SLURM_JOB_ID=(job_ids or [77] * len(world_sizes))[rank], SLURM_JOB_NODELIST="localhost",
                        SLURM_NTASKS=world_size, SLURM_PROCID=(procids or range(len(world_sizes)))[rank],
                        SLURM_LOCALID=rank, SLURM_STEP_ID=0, MASTER_PORT=port, **extra)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(S03), *map(str, args)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
        time.sleep(0.5 * rank)
    started = time.monotonic()
    outs = [p.communicate(timeout=90)[0] for p in procs]
    return [p.returncode for p in procs], outs, time.monotonic() - started


def errors(out):
    return [line for line in out.splitlines() if line.startswith("error:")]


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1])
def test_a_task_with_another_world_size_is_named_by_every_rank_at_once(first, tmp_path):
    """One task sees SLURM_NTASKS 3, its peer 2: it ended 1 with no output (the batch check rank 0 says for all) and
    rank 0 waited out --dist-timeout to say "a rank that failed first printed its own error", which none had. Now each
    ends in seconds with one line naming SLURM_NTASKS, whichever reaches the store first."""
    sizes = [2, 3] if first == 0 else [3, 2]
    args = stage_args(REPO / "data", tmp_path / "out", "--task", "common/tasks/sequences.py", "--dist-timeout", 120)
    codes, outs, seconds = launch(sizes, args)
    assert all(codes) and seconds < 60, (codes, seconds, outs)
    for out in outs:
        assert len(errors(out)) == 1 and "Traceback" not in out, out[-3000:]
        assert "SLURM_NTASKS" in errors(out)[0], errors(out)
