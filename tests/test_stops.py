"""Every stop is a safe point (common/guards/signals.py): a stop during start-up ends the run in one line, one
during evaluation saves the epoch's training whole, SIGHUP and SIGINT stop a run as SIGTERM does, and the
programs a DataLoader worker starts get the default signal handling back."""

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import (
    HANG,
    INJECT,
    KILL_WAIT,
    S01,
    S03,
    S05,
    TEST_SIZE,
    TIMING,
    assert_same_state,
    checkpoint,
    clean_env,
    finish,
    metrics,
    python,
    ranks,
    run,
    shared,
    srun_start,
    stage_args,
    start,
    torchrun,
    wait_for,
)  # fmt: skip
from test_preemption import SLOW, args, saved_mid_epoch, signal_mid_epoch_2

# the built-in task, with two places a test can make slow: the data's loading, and every evaluation batch, which
# draws from torch's generator: a save in the evaluation keeps the generators as its training left them
TASK = """
import os, time
import torch
from common.tasks.images import add_arguments, check, datasets as load, model as build

def mark(name):
    open(os.environ[name], "a").close()

def datasets(args):
    if "LOAD_MARK" in os.environ:
        mark("LOAD_MARK")
        time.sleep(60)
    return load(args)

def model(args):
    net = build(args)
    net.register_forward_pre_hook(evaluating)
    return net

def evaluating(module, inputs):
    global passed  # evaluation batches let pass before the slow ones: EVAL_AFTER
    passed = globals().get("passed", 0) + (not module.training)
    if not module.training:  # a model that draws in eval mode (a VAE's sample): the resumed run draws it again
        torch.rand(1)
    if not module.training and "EVAL_MARK" in os.environ and passed > int(os.environ.get("EVAL_AFTER", 0)):
        mark("EVAL_MARK")
        time.sleep(float(os.environ["EVAL_SLEEP"]))
"""
EVAL_SLEEP = 5  # a second per test image (five batches of two): 25 s, past the 20 s a stop may take


def eval_args(data, out, task, *extra):
    return args(data, out, "--task", task, "--test-batch-size", 2, *extra)


@pytest.fixture(scope="session")
def task_file(tmp_path_factory):
    """TASK in one file that the tests only read, the same for every pytest-xdist worker: the uninterrupted runs
    they compare against are then one (conftest.py)."""
    task = shared(tmp_path_factory) / "stops" / "task.py"
    task.parent.mkdir(exist_ok=True)
    part = task.with_name(f"task.py.{os.getpid()}")
    part.write_text(TASK)
    part.replace(task)  # whole, whichever worker writes it last
    return task


def whole_run(uninterrupted, task):
    """Stage 01's run of eval_args() never stopped (conftest.py), shared: what each stopped one resumes to."""
    return uninterrupted("python", S01, "--epochs", 2, "--batch-size", 32, "--task", task, "--test-batch-size", 2)


def stop_during_evaluation(proc, mark, signum=signal.SIGTERM, to=None):
    """Once the first evaluation batch runs, send `signum` to the process `to` (a PID; else `proc`); the output and
    the seconds from the signal to the exit."""
    wait_for(mark.exists, 120, proc)
    sent = time.monotonic()
    os.kill(to or proc.pid, signum)
    output = proc.communicate(timeout=60)[0]
    return output, time.monotonic() - sent


def saved_whole(output, code, proc, seconds, steps=8):
    """Stopped during epoch 1's evaluation: its training saved whole, at once, in one line."""
    assert proc.returncode == code and seconds < 20, (seconds, output)
    assert output.count("saved at epoch 1, step ") == 1 and f"saved at epoch 1, step {steps}: resume" in output, output
    assert output.count("Traceback") == output.count("elastic.multiprocessing.api.SignalException: Process"), output


def same_run(cut, whole):
    """The resumed run ended as the uninterrupted one: weights, and every metric but the times."""
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
    assert strip(metrics(cut)) == strip(metrics(whole))


@pytest.mark.slow
def test_stage01_stopped_during_evaluation_saves_at_once_and_resumes_bit_identical(
    uninterrupted, task_file, tiny_data, tmp_path
):
    """SIGTERM during a long evaluation was acted on after it, at the next epoch's first step: past KillWait."""
    task, cut, mark = task_file, tmp_path / "cut", tmp_path / "evaluating"
    whole = whole_run(uninterrupted, task)
    proc = start(S01, *eval_args(tiny_data, cut, task), env=clean_env(EVAL_MARK=mark, EVAL_SLEEP=EVAL_SLEEP))
    output, seconds = stop_during_evaluation(proc, mark)
    saved_whole(output, 128 + signal.SIGTERM, proc, seconds)
    assert checkpoint(cut)["epoch"] == 1 and checkpoint(cut)["step"] == 8 and not metrics(cut)
    resumed = python(S01, *eval_args(tiny_data, cut, task, "--resume"))
    assert resumed.returncode == 0 and "resumed at epoch 1, step 8" in resumed.stdout, resumed.stdout + resumed.stderr
    assert resumed.stderr == "", resumed.stderr  # torch's warning of a scheduler stepped before its optimizer
    same_run(cut, whole)
    assert float(metrics(cut)[0]["epoch_seconds"]) < EVAL_SLEEP  # its training's time: the evaluation's 5 s were in it


@pytest.mark.slow
@pytest.mark.parametrize("script", [S03, S05], ids=["03", "05"])
def test_two_ranks_under_torchrun_stopped_during_evaluation_save_at_once_and_resume_bit_identical(
    script, tiny_data, tmp_path
):
    """Stage 05's evaluation is collective (every forward pass gathers the weights): the ranks must stop at the
    same evaluation batch, as they stop at the same step."""
    task, whole, cut, mark = tmp_path / "task.py", tmp_path / "whole", tmp_path / "cut", tmp_path / "evaluating"
    task.write_text(TASK)
    assert torchrun(2, script, *eval_args(tiny_data, whole, task)).returncode == 0
    proc = start(
        script, *eval_args(tiny_data, cut, task), nproc=2, env=clean_env(EVAL_MARK=mark, EVAL_SLEEP=EVAL_SLEEP)
    )
    output, seconds = stop_during_evaluation(proc, mark)
    saved_whole(output, proc.returncode, proc, seconds)
    resumed = torchrun(2, script, *eval_args(tiny_data, cut, task, "--resume"))
    assert resumed.returncode == 0 and "resumed at epoch 1, step 8" in resumed.stdout, resumed.stdout + resumed.stderr
    if script == S03:
        same_run(cut, whole)
    else:  # sharded checkpoints: the whole weights with --save-model would need another run; the metrics suffice
        strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
        assert strip(metrics(cut)) == strip(metrics(whole))


@pytest.mark.slow
def test_stage05_stopped_again_in_the_evaluation_it_resumed_keeps_both_checkpoints(task_file, tiny_data, tmp_path):
    """Stopped in epoch 2's evaluation, resumed, and stopped again in the evaluation it runs again: the same step.
    Its save rewrote the checkpoint it had resumed from (none whole while it wrote) and deleted the one before,
    which the link checkpoint-previous still named: now the checkpoint there stands, untouched, and both links
    name folders."""
    task, cut, whole, marks = task_file, tmp_path / "cut", tmp_path / "whole", [tmp_path / "m1", tmp_path / "m2"]
    proc = start(S05, *eval_args(tiny_data, cut, task), env=clean_env(
        EVAL_MARK=marks[0], EVAL_SLEEP=EVAL_SLEEP, EVAL_AFTER=TEST_SIZE // 2))  # fmt: skip
    output, _ = stop_during_evaluation(proc, marks[0])
    assert "saved at epoch 2, step 8: resume" in output, output
    written = (cut / "epoch-2-step-8" / ".metadata").stat().st_mtime_ns
    proc = start(S05, *eval_args(tiny_data, cut, task, "--resume"), env=clean_env(
        EVAL_MARK=marks[1], EVAL_SLEEP=EVAL_SLEEP))  # fmt: skip
    output, _ = stop_during_evaluation(proc, marks[1])
    assert "resumed at epoch 2, step 8" in output and "saved at epoch 2, step 8: resume" in output, output
    links = {link: os.readlink(cut / link) for link in ("checkpoint", "checkpoint-previous")}
    assert links == {"checkpoint": "epoch-2-step-8", "checkpoint-previous": "epoch-1"}
    assert all((cut / folder / ".metadata").is_file() for folder in links.values())
    assert (cut / "epoch-2-step-8" / ".metadata").stat().st_mtime_ns == written  # not written again
    assert python(S05, *eval_args(tiny_data, cut, task, "--resume")).returncode == 0
    assert python(S05, *eval_args(tiny_data, whole, task)).returncode == 0
    strip = lambda rows: [{k: v for k, v in row.items() if k not in TIMING} for row in rows]  # noqa: E731
    assert strip(metrics(cut)) == strip(metrics(whole))


@pytest.mark.slow
def test_a_signal_to_one_rank_during_evaluation_stops_both_at_one_batch(tiny_data, tmp_path):
    """Ranks started by hand: rank 1 alone is signalled, during its evaluation; rank 0 hears of it through the
    store, and both save the epoch's training."""
    task, cut, mark = tmp_path / "task.py", tmp_path / "cut", tmp_path / "evaluating"
    task.write_text(TASK)
    procs = srun_start(2, S03, *eval_args(tiny_data, cut, task), EVAL_MARK=mark, EVAL_SLEEP=EVAL_SLEEP)
    output, seconds = stop_during_evaluation(procs[0], mark, signal.SIGUSR1, to=procs[1].pid)
    assert procs[1].wait(timeout=30) == 128 + signal.SIGUSR1
    saved_whole(output, 128 + signal.SIGUSR1, procs[0], seconds)
    procs = srun_start(2, S03, *eval_args(tiny_data, cut, task, "--resume"))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and "resumed at epoch 1, step 8" in outputs[0], outputs


@pytest.mark.slow
def test_a_second_signal_during_evaluation_and_its_save_changes_nothing(uninterrupted, task_file, tiny_data, tmp_path):
    task, cut, mark = task_file, tmp_path / "cut", tmp_path / "evaluating"
    whole = whole_run(uninterrupted, task)
    env = clean_env(EVAL_MARK=mark, EVAL_SLEEP=EVAL_SLEEP, PYTHONPATH=INJECT, FAULT_RANK=0, FAULT_SLOW_SAVE=2)
    proc = start(S01, *eval_args(tiny_data, cut, task), env=env)
    wait_for(mark.exists, 120, proc)
    sent = time.monotonic()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # scancel, then Ctrl-C, then the ssh session
        proc.send_signal(signum)
        time.sleep(2)  # the evaluation batch, then the save, which takes 2 s here
    output = proc.communicate(timeout=60)[0]
    saved_whole(output, 128 + signal.SIGTERM, proc, time.monotonic() - sent)
    assert "(SIGTERM)" in output
    resumed = python(S01, *eval_args(tiny_data, cut, task, "--resume"))
    assert resumed.returncode == 0 and "resumed at epoch 1, step 8" in resumed.stdout, resumed.stderr
    same_run(cut, whole)


@pytest.mark.slow
def test_a_signal_after_the_last_evaluation_lets_the_run_end_complete(tiny_data, tmp_path):
    """During the last epoch's row, checkpoint and summary no step is left to stop at: the run ends as it would
    have, status 0, its last checkpoint that of the last epoch, and nothing to resume."""
    task, out, mark = tmp_path / "task.py", tmp_path / "out", tmp_path / "evaluating"
    task.write_text(TASK)
    env = clean_env(EVAL_MARK=mark, EVAL_SLEEP=0, PYTHONPATH=INJECT, FAULT_RANK=0, FAULT_SLOW_SAVE=3)
    proc = start(S01, *eval_args(tiny_data, out, task, "--epochs", 1), env=env)
    wait_for(mark.exists, 120, proc)
    time.sleep(1)  # the five evaluation batches are done; the epoch's save takes 3 s
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "saved at" not in output and "Traceback" not in output, output
    assert checkpoint(out)["epoch"] == 1 and checkpoint(out)["step"] == 0 and len(metrics(out)) == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_a_stop_during_start_up_is_one_line_and_the_run_starts_again(signum, tiny_data, tmp_path):
    """A signal while the data loads (or the rendezvous, the fingerprint, the model): nothing to save, nothing lost.
    Before, SIGTERM ended the run with no line at all (status -15), and SIGHUP likewise."""
    task, out, mark = tmp_path / "task.py", tmp_path / "out", tmp_path / "loading"
    task.write_text(TASK)
    proc = start(S01, *args(tiny_data, out, "--task", task, "--epochs", 1), env=clean_env(LOAD_MARK=mark))
    wait_for(mark.exists, 120, proc)
    sent = time.monotonic()
    proc.send_signal(signum)
    stdout, _ = proc.communicate(timeout=2 * KILL_WAIT)
    seconds = time.monotonic() - sent
    assert proc.returncode == 128 + signum and seconds < KILL_WAIT, (seconds, stdout)  # after the signal: Slurm's bound
    said = [line for line in stdout.splitlines() if "during start-up" in line]
    assert said == [f"stopped by {signal.Signals(signum).name} during start-up, before the first step: nothing was "
                    "saved and nothing is lost; start the run again as it was started"], stdout  # fmt: skip
    assert "error:" not in stdout and "Traceback" not in stdout, stdout  # a request, not an error: srun's other tasks
    again = python(S01, *args(tiny_data, out, "--task", task, "--epochs", 1))
    assert again.returncode == 0 and len(metrics(out)) == 1, again.stdout + again.stderr


WRAPPED = """
import os, time
from common.tasks.images import add_arguments, check, datasets, model as build

def model(args):
    net = build(args)
    listed = type(net).named_parameters

    def named_parameters(self, *a, **k):  # DDP's constructor lists them first (model.to() does not): rank 1 waits
        if os.environ["RANK"] == "1" and not os.path.exists(os.environ["WRAP_MARK"]):
            open(os.environ["WRAP_MARK"], "a").close()
            time.sleep(120)
        return listed(self, *a, **k)

    net.named_parameters = named_parameters.__get__(net)
    return net
"""


@pytest.mark.slow
def test_a_stop_while_ddp_is_constructed_is_one_line_on_every_rank(tiny_data, tmp_path):
    """SIGTERM to every rank (scancel) while DDP is constructed: rank 1 in the constructor's Python, rank 0 in its
    first collective, waiting for rank 1. The general stop path (signals.hold()) had no test: each rank ends with at
    most one line, rank 0's the start-up stop or its error, and no traceback."""
    task, out, mark = tmp_path / "task.py", tmp_path / "out", tmp_path / "wrapping"
    task.write_text(WRAPPED)
    procs = ranks(S03, [args(tiny_data, out, "--task", task, "--epochs", 1)] * 2, WRAP_MARK=mark)
    wait_for(mark.exists, 120, procs[1])
    time.sleep(1)  # rank 0 in DDP's first collective
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    ended = finish(procs, timeout=HANG)
    for rank, end in enumerate(ended):
        lines = [line for line in (end.stdout + end.stderr).splitlines() if line.startswith(("error:", "stopped by"))]
        assert end.returncode != 0 and "Traceback" not in end.stderr + end.stdout, (rank, end.stderr[-3000:])
        assert len(lines) == (rank == 0), (rank, lines, end.stderr[-2000:])
        assert end.seconds < KILL_WAIT, (rank, end.seconds)  # Slurm's bound after the signal


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_torch_is_imported_is_the_same_one_line(signum, tiny_data, tmp_path):
    """Ctrl-C (or a scancel) in a run's first seconds, while `import torch` loads libtorch, before rails.run() can
    catch anything: the start-up line and 128 + the signal. Before, Ctrl-C there was a KeyboardInterrupt traceback
    out of torch's imports, and SIGTERM ended the run with no line at all (status -15)."""
    proc = start(S01, *args(tiny_data, tmp_path / "out"))

    def importing_torch():  # libtorch is mapped a second or more before the import of torch returns
        return "libtorch_cpu" in Path(f"/proc/{proc.pid}/maps").read_text()

    wait_for(importing_torch, 60, proc)
    proc.send_signal(signum)
    proc.send_signal(signum)  # pressed twice: the first counts
    output = proc.communicate(timeout=HANG)[0]
    assert proc.returncode == 128 + signum, output
    assert output.splitlines() == [f"stopped by {signal.Signals(signum).name} during start-up, before the first "
                                   "step: nothing was saved and nothing is lost; start the run again as it was "
                                   "started"], output  # fmt: skip
    assert not (tmp_path / "out").exists()


TRIP = """
import importlib.abc, os, runpy, signal, sys
class Trip(importlib.abc.MetaPathFinder):  # SIGINT to itself as the first module after the stage's first line loads
    def find_spec(self, name, path=None, target=None):
        if name == "importlib.metadata":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Trip())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_stop_just_after_the_stages_first_line_is_the_same_one_line(tmp_path):
    """Ctrl-C a few tens of milliseconds into a run, as the torch-version check imports importlib.metadata: that
    import came before the stop's handlers, and the stop was a KeyboardInterrupt traceback out of it. The
    handlers now come first: the start-up line and 130, as while torch is imported."""
    out = run([sys.executable, "-c", TRIP, str(S01), "--output-dir", tmp_path / "out"])
    assert out.returncode == 130 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("stopped by SIGINT during start-up, before the first step"), out.stderr


# a finalizer (a __del__, as the collector runs them anywhere) that is running as the signal comes
DROPPED = """
import os, signal

class Dropped:
    def __del__(self):
        os.kill(os.getpid(), signal.{0})
        sum(range(10_000))  # the handler runs in here: what it raises, Python prints and drops
"""


def test_a_stop_that_comes_in_a_finalizer_still_ends_the_run(tiny_data, tmp_path):
    """SIGTERM while a finalizer ran at start-up (here in the task's model()): the handler's Stopped was dropped
    by Python ("Exception ignored", a traceback), and the run trained to its end, status 0, the stop lost. The
    stop is kept and ends the run at the next phase: its line, 143, no epoch trained."""
    task = tmp_path / "task.py"
    task.write_text(
        DROPPED.format("SIGTERM")
        + """
from common.tasks.images import add_arguments, check, datasets, model as build

def model(args):
    Dropped()
    return build(args)
"""
    )
    out = python(S01, *args(tiny_data, tmp_path / "out", "--task", task, "--epochs", 1))
    assert out.returncode == 143 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("stopped by SIGTERM during start-up, before the first step"), out.stderr
    assert "epoch   1" not in out.stdout and not (tmp_path / "out" / "checkpoint.pt").exists(), out.stdout


def test_a_stop_that_comes_in_a_finalizer_during_the_imports_ends_the_run(tiny_data, tmp_path):
    """Likewise while the stage imports: the exit its handler raised was dropped, and every later stop ignored."""
    trip = DROPPED.format("SIGINT") + TRIP.replace("os.kill(os.getpid(), signal.SIGINT)", "Dropped()")
    out = run([sys.executable, "-c", trip, str(S01), *args(tiny_data, tmp_path / "out", "--epochs", 1)])
    assert out.returncode == 130 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("stopped by SIGINT during start-up, before the first step"), out.stderr


# the first training step spends seconds in one C call (a matmul), where signals are only noted by the C handler
LONG_C_CALL = """
import os, torch
from common.tasks.images import add_arguments, check, datasets, model as build

def model(args):
    net = build(args)
    net.register_forward_pre_hook(long_call)
    return net

def long_call(module, inputs):
    if module.training and not os.path.exists(os.environ["C_MARK"]):
        open(os.environ["C_MARK"], "a").close()
        torch.ones(5000, 5000) @ torch.ones(5000, 5000)
"""


def test_the_first_of_two_stops_that_come_in_one_c_call_counts(tiny_data, tmp_path):
    """SIGTERM, then SIGHUP, while the step is in one C call: Python ran their handlers by number, SIGHUP's first,
    and the run said "(SIGHUP)" and ended with 129. The first that came counts: "(SIGTERM)", 143."""
    task, mark = tmp_path / "task.py", tmp_path / "in-c"
    task.write_text(LONG_C_CALL)
    proc = start(S01, *args(tiny_data, tmp_path / "out", "--task", task, "--epochs", 1), env=clean_env(C_MARK=mark))
    wait_for(mark.exists, 120, proc)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        time.sleep(0.2)
        proc.send_signal(signum)
    output = proc.communicate(timeout=HANG)[0]
    assert proc.returncode == 128 + signal.SIGTERM and "resume with --resume (SIGTERM)" in output, output


@pytest.mark.slow
def test_stage03_under_torchrun_stopped_by_sighup_saves_and_resumes(tiny_data, tmp_path):
    """A closed ssh session: SIGHUP to torchrun, which passes it on to its workers' groups. Before, the run ended
    with no save (torchrun's traceback and the ranks' end by the signal)."""
    cut, run = tmp_path / "cut", str(uuid.uuid4())
    proc = start(S03, *args(tiny_data, cut), nproc=2, env=clean_env(**SLOW, TEST_RUN=run))
    output, seconds = signal_mid_epoch_2(proc, cut, signal.SIGHUP)
    assert proc.returncode != 0 and seconds < 20 and "error:" not in output, output
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    assert "(SIGHUP)" in output
    resumed = torchrun(2, S03, *args(tiny_data, cut, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr


WORKER_TASK = """
import json, os, signal, subprocess
import torch
from common.tasks.images import add_arguments, check, model

class Decoding(torch.utils.data.TensorDataset):
    def __getitem__(self, i):
        report = os.environ["REPORT"]
        if torch.utils.data.get_worker_info() and not os.path.exists(report):
            child = subprocess.Popen(["sleep", "60"])  # a decoder
            status = dict(line.split(":\\t") for line in open(f"/proc/{child.pid}/status").read().splitlines()
                          if line.startswith(("SigBlk", "SigIgn")))
            child.terminate()
            try:
                code = child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                code = None
            with open(report, "w") as f:
                json.dump({"status": status, "code": code}, f)
        return super().__getitem__(i)

def datasets(args):
    make = lambda n: Decoding(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    return make(64), make(10)
"""


def test_a_program_a_dataloader_worker_starts_gets_the_default_signal_handling(tmp_path):
    """The worker lets the stops pass to its rank; the decoder it starts must not inherit that: before, SIGTERM
    stayed blocked in it (and SIGINT, SIGUSR1 ignored), and its terminate() never ended it."""
    task, report = tmp_path / "task.py", tmp_path / "report.json"
    task.write_text(WORKER_TASK)
    workers = stage_args(tmp_path, tmp_path / "out", "--task", task, "--epochs", 1, "--num-workers", 1)  # the last wins
    run = python(S01, *workers, REPORT=report)
    assert run.returncode == 0, run.stdout + run.stderr
    found = json.loads(report.read_text())
    stops = sum(1 << (s - 1) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP))
    assert int(found["status"]["SigBlk"], 16) & stops == 0, found
    assert int(found["status"]["SigIgn"], 16) & stops == 0, found
    assert found["code"] == -signal.SIGTERM, found


TEARDOWN = """
import os, time
from common.tasks.images import add_arguments, check, datasets, model


class Slow:  # destroyed with the task's module, in Python's teardown: after it resets the handlers of signals
    def __del__(self, open=open, mark=os.environ["TEARDOWN_MARK"], sleep=time.sleep):  # the module's names are gone
        open(mark, "a").close()
        sleep(3)


slow = Slow()
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", [S01, S03])
def test_a_signal_in_the_interpreters_teardown_after_done_leaves_status_0(script, tiny_data, tmp_path):
    """A run of one process that printed `done:` ends in Python's teardown, which resets every signal's handler to
    the default: SIGTERM there (Slurm's, a requeue's) killed the finished run, status 143 and no line, and a job
    script took it for a stopped run. After the last exit function a stop changes nothing: it ends with 0."""
    task, mark = tmp_path / "task.py", tmp_path / "tearing-down"
    task.write_text(TEARDOWN)
    proc = start(
        script, *args(tiny_data, tmp_path / "out", "--task", task, "--epochs", 1), env=clean_env(TEARDOWN_MARK=mark)
    )
    wait_for(mark.exists, 120, proc)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "done: 1 epochs" in output, (proc.returncode, output[-2000:])
