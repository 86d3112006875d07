"""Every process ends, and a failure on one side is one line on every side: a task's thread neither keeps a run nor a
tool alive past its verdict, nor fails it silently; a signal after the verdict ends it; a rank refused at start-up,
or launched unlike its peers, is named by the others before any wait. What each test proves is in tests/FAILURES.md."""

import datetime
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from helpers import (
    HANG,
    INJECT,
    REPO,
    S01,
    S03,
    S05,
    clean_env,
    free_job_id,
    free_port,
    metrics,
    one_error,
    python,
    srun_start,
    stage_args,
    torchrun_cmd,
    wait_for,
)

from common.environment import Launch
from common.guards import arrival, ending, rendezvous

TASK = (
    "import atexit, threading, time\nfrom common.tasks.sequences import *\nfrom common.tasks import sequences as base\n"
)
SLEEPER = (
    TASK
    + "def model(args):\n    threading.Thread(target=time.sleep, args=(3600,)).start()\n    return base.model(args)\n"
)
RAISER = TASK + (
    "def broken():\n    raise ValueError('the prefetcher broke')\n"  # line 5: the thread's raise
    "def model(args):\n    threading.Thread(target=broken, name='prefetch').start()\n    time.sleep(1)\n"
    "    return base.model(args)\n"
)
LATE = TASK + "def model(args):\n    atexit.register(time.sleep, 3600)\n    return base.model(args)\n"
FAILING_EXIT = TASK + (
    "def boom():\n    raise ValueError('the cache could not be written')\n"  # line 5
    "def model(args):\n    atexit.register(boom)\n    return base.model(args)\n"
)


def task(tmp_path, source):
    path = tmp_path / "my_task.py"
    path.write_text(source)
    return path


def test_a_thread_a_task_left_running_does_not_keep_the_run(tmp_path):
    """The task starts a thread that is no daemon: the run printed its last epoch and never ended (Python's teardown
    waits for the thread), holding its GPUs until the job's time limit. It ends with its status."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, SLEEPER), "--epochs", 1)
    out = python(S01, *args, timeout=HANG)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_an_error_in_a_tasks_thread_is_one_line_and_fails_the_run(tmp_path):
    """Python printed the thread's traceback and the run went on to end 0; now one line naming the thread, the error
    and its place in the task, status 1."""
    path = task(tmp_path, RAISER)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", path, "--epochs", 1), timeout=HANG)
    assert out.returncode == 1, out.stderr[-2000:]
    one_error(out, "in thread prefetch", "ValueError: the prefetcher broke", f"{path}:5")


def test_a_signal_after_the_verdict_ends_the_run_with_its_status(tmp_path):
    """After the verdict the stops were ignored (SIG_IGN): a run that something still held (here an exit function of
    the task's that never returns) stayed until the time limit, deaf to scancel. A stop now ends it, status kept."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, LATE), "--epochs", 1)
    proc = subprocess.Popen(
        [sys.executable, str(S01), *args],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(
        lambda: (tmp_path / "out" / "metrics.csv").exists() and (tmp_path / "out" / "checkpoint.pt").exists(), 90, proc
    )
    time.sleep(3)  # the run's end: its last line, then the task's exit function
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG) == 0, proc.stdout.read()[-2000:]


@pytest.mark.slow
def test_an_exit_function_that_raises_is_one_line_and_fails_the_run(tmp_path):
    """A task's atexit function that raised: Python's "Exception ignored" traceback, and status 0. One
    line naming it and its place, status 1."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, FAILING_EXIT), "--epochs", 1)
    out = python(S01, *args, timeout=HANG)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "done: 1 epochs" in out.stdout, out.stderr
    assert out.stderr.splitlines()[-1] == (
        "error: an exit function raised ValueError: the cache could not be written (at my_task.py:5, in boom)"
    )


@pytest.mark.slow  # the run's own case runs in make test
def test_a_tool_ends_though_a_task_left_a_thread_running(tmp_path):
    """tools/plan.py with such a task printed its plan and never ended."""
    plan = [sys.executable, str(REPO / "tools/plan.py"), "--task", task(tmp_path, SLEEPER), "--batch-size", "8"]
    out = subprocess.run(plan, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=HANG)
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
        env = clean_env(
            SLURM_JOB_ID=(job_ids or [77] * len(world_sizes))[rank],
            SLURM_JOB_NODELIST="localhost",
            SLURM_NTASKS=world_size,
            SLURM_PROCID=(procids or range(len(world_sizes)))[rank],
            SLURM_LOCALID=(procids or range(len(world_sizes)))[rank],
            SLURM_STEP_ID=0,
            MASTER_PORT=port,
            **extra,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(S03), *map(str, args)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
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


def store_of(job, world_size=2, rank=0):
    """A rendezvous store served here, with the watchdog's keys as rank `rank` of job `job` would see them."""
    served = dist.TCPStore(
        "127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    return served, arrival.space(served)


def test_ranks_launched_unlike_or_claiming_one_rank_are_named(monkeypatch):
    """arrival.py, the fastest check of its guarantees: the first rank's launch is the reference; another world size
    is named as SLURM_NTASKS, another job as another launch's store, a second task of one rank as such; a failure a
    rank told is heard by the others with its line."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    served, store = store_of(100)
    assert arrival.launched(store, 0, 2) is None and arrival.launched(store, 1, 2) is None
    assert "SLURM_NTASKS is 3 here but 2 on rank 0" in arrival.launched(store, 1, 3)
    monkeypatch.setenv("SLURM_JOB_ID", "40100")
    assert "is another launch's (job 100; this is job 40100)" in arrival.launched(store, 1, 2)
    assert arrival.duplicate(store, 1) is None and "another task has SLURM_PROCID 1 too" in arrival.duplicate(store, 1)
    assert arrival.heard(store, 0, 2) is None
    store.set("failed/1", "error: rank 1: no GPU here")
    store.add("failures", 1)
    assert arrival.heard(store, 0, 2) == "error: rank 0: rank 1 failed at start-up, before the ranks met: no GPU here"


@pytest.mark.parametrize(
    "error, said",
    [
        (
            "[gloo/transport/tcp/pair.cc:144] Connect timeout [10.1.2.3]:5555",
            "10.1.2.3]:5555 did not answer (Connect timeout",
        ),
        (
            "Connection refused (127.0.0.1:34567)",
            "127.0.0.1:34567 did not answer (Connection refused): the ranks cannot",
        ),
        ("Wait timeout after 30000ms, keys: /default_pg/0//cpu//0/1", "Wait timeout after 30000ms"),
        (None, "no error within --dist-timeout, every rank still answering"),
    ],
)
def test_the_network_is_blamed_only_for_an_address_that_did_not_answer(error, said):
    """Every rank arrived and still beats: a store's wait that timed out is torch's text, not GLOO_SOCKET_IFNAME
    (it was said after a restart, for another SLURM_NTASKS, for a peer stopped in the rendezvous); an address that
    refused or timed out is the network."""
    served, store = store_of(1)
    for rank in (0, 1):
        store.set(f"alive/{rank}", str(time.time()))
    line = arrival.unformed(store, 0, 2, error and RuntimeError(error))
    assert said in line and ("GLOO_SOCKET_IFNAME" in line) == ("did not answer" in said), line


def test_a_rank_gone_silent_in_the_rendezvous_is_named_not_the_network():
    served, store = store_of(1)
    store.set("alive/0", str(time.time()))
    store.set("alive/1", str(time.time() - 20))  # stopped (SIGSTOP) since it arrived
    line = arrival.unformed(store, 0, 2, RuntimeError("Connection refused (127.0.0.1:34567)"))
    assert "rank 1 went silent since" in line and "GLOO_SOCKET_IFNAME" not in line, line


def test_a_rank_that_cannot_hear_rank_0s_verdict_says_its_own(monkeypatch):
    """Rank 1 arrived first and failed its own check, a verdict rank 0 says for all where it meets it too: it waited
    to read rank 0's line, but rank 0, launched unlike the first to arrive, ended with its own once rank 1 had told
    its failure, and the store with it. Rank 1 ended 1 with no line at all (test_a_task_with_another_world_size_is_
    named_by_every_rank_at_once, under load). Now a store gone while it waits means no one said its line: it does."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    served = [store_of(100)[0]]
    port = served[0].port

    def rank_0_ends():  # as held() lets it: every rank has read its line or told its own
        wait_for(lambda: served[0].check(["watchdog/failed/1"]), timeout=HANG)
        served.clear()  # the store ends with rank 0's process

    threading.Thread(target=rank_0_ends, daemon=True).start()
    line = "error: --batch-size 64 is not a multiple of the world size 3"
    said = arrival.tell(Launch(1, 1, 2, "127.0.0.1", port), 5, line, alone=True)
    assert said == "error: rank 1: --batch-size 64 is not a multiple of the world size 3" and not served


def test_a_rank_that_arrived_first_names_the_launch_rank_0_found_unlike(monkeypatch):
    """Rank 1 (SLURM_NTASKS 3) failed a check rank 0 says for all (--batch-size 64 by 3) and reached the store first,
    so its launch was the one the others are compared with; rank 0 (SLURM_NTASKS 2) arrived next and named the launch
    unlike, but rank 1 said its batch line (test_a_task_with_another_world_size_is_named_by_every_rank_at_once, in
    CI): it had not read rank 0's line, or rank 0 ended with its store before rank 1 read it (held() counted rank 1
    as done once it had told its own). Now rank 0 waits for the read, and rank 1 names the cause rank 0 found."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    served = [store_of(100)[0]]
    port = served[0].port

    def rank_0_arrives():  # after rank 1 told its line; rank 0's watchdog tells its own and ends (Watchdog.say())
        store = arrival.space(served[0])
        wait_for(lambda: store.check(["failed/1"]), timeout=HANG)
        store.set("failed/0", arrival.launched(store, 0, 2))
        store.add("failures", 1)
        arrival.held(store, 10, 2)
        served.clear()  # the store ends with rank 0's process (and its last reference, `store`, on return)

    rank_0 = threading.Thread(target=rank_0_arrives, daemon=True)
    rank_0.start()
    line = "error: --batch-size 64 is the global batch: it must divide by the world size 3"
    said = arrival.tell(Launch(1, 1, 3, "127.0.0.1", port), 5, line, alone=True)
    rank_0.join(timeout=HANG)  # its store ends in this process, not in the interpreter's teardown
    assert not served
    assert said.startswith("error: rank 1: its launch differs from rank 0's: ") and "batch" not in said, said
    assert "SLURM_NTASKS is 2 here but 3 on rank 1" in said, said


def test_a_port_another_jobs_store_holds_is_named_as_such(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    served, store = store_of(100)
    arrival.launched(store, 0, 2)
    monkeypatch.setenv("SLURM_JOB_ID", "40100")
    assert "by Slurm job 100's rendezvous store" in rendezvous.port_in_use(served.port)


@pytest.mark.slow
@pytest.mark.parametrize("procids", [[0, 1, 1], [0, 0, 1]])
def test_a_second_task_of_one_rank_is_named_by_every_rank(procids, tmp_path):
    """Two tasks with SLURM_PROCID 1: the ranks waited out --dist-timeout. Now each of the three ends in seconds,
    one line each, naming the rank two tasks claim. Two with SLURM_PROCID 0 were named by the output folder the
    other holds ("in use by another run"): the lock names a second task of its own launch as such."""
    args = stage_args(
        REPO / "data",
        tmp_path / "out",
        "--task",
        "common/tasks/sequences.py",
        "--dist-timeout",
        120,
        "--batch-size",
        63,
    )
    codes, outs, seconds = launch([3, 3, 3], args, procids=procids)
    assert all(codes) and seconds < 60, (codes, seconds, outs)
    for out in outs:
        assert len(errors(out)) == 1 and "Traceback" not in out, out[-3000:]
        assert f"another task has SLURM_PROCID {procids[1]} too" in errors(out)[0], errors(out)


@pytest.mark.slow
def test_a_task_of_another_job_on_this_port_is_named_and_the_job_it_met_is_untouched(tmp_path):
    """Two jobs whose ids are 40,000 apart share a port (20000 + id % 40000): the second job's rank 1 joined the first
    job's store and waited 57.6 s past --dist-timeout 30, three C++ stack traces, blaming rank 0. Now it ends within
    --dist-timeout + 10 s in one line naming the other job's store, and writes nothing there: the first job finishes."""
    job = free_job_id()
    args = stage_args(REPO / "data", tmp_path / "a", "--task", "common/tasks/sequences.py", "--epochs", 2)
    # the first job's rank 0 sleeps 0.3 s before each of its 126 steps (63 an epoch): it trains for 38 s after its
    # first progress line, on no CPU, as long as the other job's task may take (40 s) to end
    first = srun_start(2, S03, *args, job_id=job, PYTHONPATH=f"{INJECT}:{REPO}", FAULT_RANK=0, FAULT_SLEEP=0.3)
    printed = []

    def read():  # rank 0's lines as they come
        for line in first[0].stdout:
            printed.append(line)

    threading.Thread(target=read, daemon=True).start()
    wait_for(lambda: any(" batch 0/" in line for line in printed), 120, first[0])  # the first job's group formed
    other = stage_args(REPO / "data", tmp_path / "b", "--task", "common/tasks/sequences.py", "--dist-timeout", 30)
    env = clean_env(
        SLURM_JOB_ID=job + 40000,
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS=2,
        SLURM_PROCID=1,
        SLURM_LOCALID=1,
        SLURM_STEP_ID=0,
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(S03), *other], env=env, cwd=REPO, capture_output=True, text=True, timeout=90
    )
    assert time.monotonic() - start < 40 and out.returncode == 1, out.stderr[-3000:]
    one_error(out, "rank 1", f"is another launch's (job {job}; this is job {job + 40000})", "MASTER_PORT")
    assert len(metrics(tmp_path / "a")) < 2 and [p.wait(timeout=300) for p in first] == [0, 0], "".join(printed)


STOPPING = (
    TASK
    + "import os, signal\ndef model(args):\n    if os.environ['RANK'] == '0':\n        raise RuntimeError('no such layer')\n    return base.model(args)\n"
)
KILLED = TASK + (
    "import os, signal\ndef model(args):\n"
    "    if os.environ['RANK'] == '1' and int(os.environ['TORCHELASTIC_RESTART_COUNT']) < 10:\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return base.model(args)\n"
)


@pytest.mark.slow
def test_a_failure_of_rank_0_alone_in_stage05_is_one_line_on_rank_1(tmp_path):
    """Rank 0's model() fails at start-up under torchrun: rank 1's line was a 40-line traceback ending in Stopped
    (torchrun's SIGTERM raised while its own failure was being explained). Now one line from each rank."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, STOPPING), "--epochs", 1)
    out = subprocess.run(
        torchrun_cmd(2, S05, *args), env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    ours = out.stdout + "\n".join(line for line in out.stderr.splitlines() if not line.startswith(("[", " ", "W")))
    assert out.returncode and "signals.Stopped" not in out.stderr and "common/" not in out.stderr, out.stderr[-3000:]
    assert any("rank 0: RuntimeError: no such layer" in line for line in errors(ours)), out.stderr[-3000:]


BEHIND = """import os, time
from common.tasks import sequences
add_arguments, model = sequences.add_arguments, sequences.model


def datasets(args):
    if os.environ["RANK"] == "0":
        time.sleep(3)  # rank 0 reaches the verdict every rank reaches last
    tokens, labels = sequences.sequences(8, 16, 16, 0)
    return (sequences.TensorDataset(tokens, labels.float()),) * 2
"""


@pytest.mark.slow
def test_a_verdict_rank_0_reaches_last_is_said_not_the_stop_torchrun_sent_it(tmp_path):
    """Every rank refuses float labels under the default loss, and rank 0 says it for all. Rank 1, there first, ended
    with status 1 at once; torchrun stopped rank 0 before its verdict, and the one line was "stopped by SIGTERM during
    start-up": the cause unsaid. A rank that ends with rank 0's line waits for rank 0 to reach it (rails.ruled())."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task(tmp_path, BEHIND), "--epochs", 1)
    out = subprocess.run(
        torchrun_cmd(2, S03, *args), env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    said = errors(out.stdout + out.stderr)
    assert out.returncode and len(said) == 1 and "a label of torch.float32" in said[0], out.stderr[-3000:]
    assert "stopped by" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_ten_torchrun_restarts_in_a_row_each_form_the_process_group(tmp_path):
    """torchrun --max-restarts after a SIGKILL of a rank: the restarted ranks read the previous attempt's addresses
    from torchrun's store ("Connection refused" to its ports) in 2 tries of 6, each blaming the network. Rank 1 is
    killed in 10 attempts in a row, after the process group formed: the 11th trains."""
    args = stage_args(
        REPO / "data", tmp_path / "out", "--task", task(tmp_path, KILLED), "--epochs", 1, "--dist-timeout", 30
    )
    out = subprocess.run(
        torchrun_cmd(2, S03, *args, restarts=10), env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GLOO_SOCKET_IFNAME" not in out.stderr and len(metrics(tmp_path / "out")) == 1


@pytest.mark.slow  # smaller causes named; make test keeps the unresolvable address
@pytest.mark.parametrize(
    "addr, said",
    [
        ("::1", ["MASTER_ADDR ::1 is an IPv6 address", "localhost"]),
        ("127.0.0.1:29500", ["MASTER_ADDR 127.0.0.1:29500 holds a port", "MASTER_PORT to the port"]),
        ("10.255.255.1", ["MASTER_ADDR 10.255.255.1 is 10.255.255.1, not an address of this host"]),
    ],
    ids=["ipv6", "a port in it", "not this host's"],
)
def test_a_master_addr_rank_0_cannot_serve_at_is_one_line_naming_why(addr, said, tmp_path):
    """MASTER_ADDR=::1 was a ValueError out of torch ("Port could not be cast"): tcp://::1:29500 holds no port; an
    address with a port in it was called IPv6; an address of another host had rank 0 blame "another program" on its
    port: its own client of the store met another host, or none."""
    args = stage_args(REPO / "data", tmp_path / "out", "--task", "common/tasks/sequences.py", "--dist-timeout", 10)
    out = python(S03, *args, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR=addr, MASTER_PORT=free_port())
    one_error(out, *said)


def test_a_mis_shaped_checkpoint_and_an_unused_parameter_are_lines_naming_the_key(tmp_path):
    """The mis-shaped checkpoint's line ended at "for Linear:", naming no key; DDP's unused-parameter error advised
    find_unused_parameters=True, a flag no stage takes."""
    from types import SimpleNamespace

    import torch

    from common.guards import failure, rails
    from common.options import resuming

    guard = rails.Guard()
    guard.args = SimpleNamespace(task="my_task.py", output_dir=None)
    torch.save({"model": torch.nn.Linear(3, 2).state_dict()}, tmp_path / "checkpoint.pt")
    try:
        resuming.restore(tmp_path / "checkpoint.pt", {"model": torch.nn.Linear(2, 2)}, None)
    except RuntimeError as err:
        said = failure.explain(err, guard)
    assert "size mismatch for weight: copying a param with shape torch.Size([2, 3])" in said and "\n" not in said
    try:
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
            "that your module has parameters that were not used in producing loss. You can enable unused parameter "
            "detection by passing the keyword argument `find_unused_parameters=True` to `torch.nn.parallel."
            "DistributedDataParallel`\nParameter indices which did not receive grad for rank 0: 2 3"
        )
    except RuntimeError as err:
        said = failure.explain(err, guard)
    assert "(indices 2 3)" in said and "find_unused_parameters" not in said and "forward()" in said, said


COLUMN = TASK + (
    "import torch\nclass Column(torch.utils.data.Dataset):\n    def __init__(self, real):\n        self.real = real\n"
    "    def __len__(self):\n        return len(self.real)\n    def __getitem__(self, i):\n"
    "        x, y = self.real[i]\n        return x, torch.tensor([int(y)])\n"
    "def datasets(args):\n    train, test = base.datasets(args)\n    return Column(train), Column(test)\n"
)


@pytest.mark.slow  # one shape of many a task's labels can have
def test_labels_of_shape_b_1_are_one_line_naming_the_shape(tmp_path):
    """Labels of shape [B, 1] gave torch's text ("0D or 1D target tensor expected") blamed on train.py's loss line."""
    path = task(tmp_path, COLUMN)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", path, "--epochs", 1), timeout=HANG)
    one_error(out, f"--task {path}: a batch of labels of shape [64, 1]", "shape [B]")


def test_a_second_rank_0_is_named_as_such(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    served, store = store_of(100)
    arrival.launched(store, 0, 2)
    assert "two tasks claim rank 0" in rendezvous.port_in_use(served.port)


SETTLING = """
import sys, time
from common.guards import failure, rails
explain = failure.settle
def slow(err, guard):  # a failure being explained while the ranks' launcher sends its SIGTERM (torchrun, srun)
    print("settling", flush=True)
    time.sleep(3)
    return explain(err, guard)
failure.settle = slow
def main(guard):
    raise ValueError("no such layer")
rails.run(main)
"""


def test_a_stop_while_a_failure_is_explained_leaves_its_one_line(tmp_path):
    """Stage 05, rank 0 failing alone at start-up: torchrun's SIGTERM reached rank 1 while its own failure was being
    explained, and raised Stopped there: a 40-line traceback. The stop is noted; the failure's line and status stand."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SETTLING],
        env=clean_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "settling\n"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=HANG)
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.startswith("error: ValueError: no such layer (at ") and stderr.count("\n") == 1, stderr


PENDING = """
import _thread, os, signal, socket, sys, threading, time
from torch.utils.data._utils import signal_handling
from common.guards import rails
signum = getattr(signal, sys.argv[1])
if signum == signal.SIGCHLD:  # a DataLoader worker of this process, ended: torch's handler raises its line
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the kernel's own SIGCHLD: never delivered
    if (worker := os.fork()) == 0:
        time.sleep(60)
        os._exit(0)
    signal_handling._set_worker_pids(1, (worker,))
    signal_handling._set_SIGCHLD_handler()
    os.kill(worker, signal.SIGKILL)
    os.waitid(os.P_PID, worker, os.WEXITED | os.WNOWAIT)
def main(guard):  # the signal arrives while this rank waits in C (a collective's wait), which then fails
    waiting, _ = socket.socketpair()
    waiting.settimeout(1.0)
    threading.Timer(0.2, _thread.interrupt_main, args=(signum,)).start()
    waiting.recv(1)
rails.run(main)
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGCHLD"])
def test_a_signal_pending_as_main_fails_is_one_line(signum):
    """A signal that arrived while a rank waited in C is raised as rails.run() begins its verdict: a stop raised
    where nothing caught it, and torch's line for a DataLoader worker's end, printed tracebacks (the first in CI,
    test_a_stop_while_ddp_is_constructed_is_one_line_on_every_rank). The stop is why the run ended; the worker's
    end, which workers.lost() names where the loader failed, leaves this failure its line."""
    out = python("-c", PENDING, signum)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    if signum == "SIGTERM":
        assert out.returncode == 143 and out.stderr.startswith("stopped by SIGTERM during start-up"), out
    else:
        one_error(out, "TimeoutError: timed out")
