"""One reading of the launcher, and one line for any failure: the invariants of common/environment.py's
launcher() and common/guards/rails.py's run(). What each test proves is in tests/FAILURES.md."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch
from helpers import (
    HANG,
    REPO,
    S01,
    S03,
    clean_env,
    free_port,
    metrics,
    one_error,
    python,
    run,
    srun_like,
    stage_args,
    torchrun,
    wait_for,
)

from common import cli, data, models
from common.environment import is_rank0, launcher
from common.guards import check, failure, preflight, rails
from common.options import flags, holdout, resuming

SMALL_PLAN = ["--model", "cnn", "--dataset", "cifar10", "--batch-size", "8"]  # a plan that takes a second
TORCHRUN = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2"}  # fmt: skip


@pytest.mark.parametrize(
    "env, rank",
    [({**TORCHRUN, "RANK": "00"}, 0), ({**TORCHRUN, "RANK": " 0"}, 0), ({**TORCHRUN, "RANK": " 1"}, 1),
     ({**SRUN, "SLURM_PROCID": "00"}, 0), ({**SRUN, "SLURM_NTASKS": "1"}, 0),  # an srun step without SLURM_PROCID
     # srun torchrun: torchrun's rank wins (torchrun names its run in every worker: TORCHELASTIC_RUN_ID)
     ({**SRUN, "SLURM_PROCID": "1", **TORCHRUN, "RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, 0),
     ({**SRUN, "SLURM_PROCID": "0", **TORCHRUN, "RANK": "1", "TORCHELASTIC_RUN_ID": "x"}, 1)],
)  # fmt: skip
def test_one_reading_of_the_launcher(env, rank):
    """The rank the guard rails accept is the rank the process group joins as and the one is_rank0() reads:
    before, RANK=00 joined as rank 0 while is_rank0() said no, and the run printed and wrote nothing."""
    check.check_environment(env)
    assert launcher(env).rank == rank
    assert is_rank0(env) == (rank == 0)


@pytest.mark.parametrize("value", ["²", "1.0", "-1", "0x1", "1_0"])
def test_a_rank_the_launcher_cannot_read_is_refused_not_guessed(value):
    """What the check refuses, launcher() reads as no rank (and no rank 0), never as a number of its own."""
    env = {**TORCHRUN, "RANK": value}
    with pytest.raises(SystemExit, match="RANK="):
        check.check_environment(env)
    assert launcher(env).rank is None and not is_rank0(env)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, env",
    [(S03, {"RANK": "00", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}),
     (S01, {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"})],  # an srun step without SLURM_PROCID
)  # fmt: skip
def test_rank_0_of_a_launch_prints_and_writes(script, env, tiny_data, tmp_path):
    """Before, these trained, printed nothing, wrote nothing and ended with status 0."""
    env = env | ({"MASTER_PORT": free_port()} if "RANK" in env else {})
    out = python(script, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--limit", 64), **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 1" in out.stdout.lower() and len(metrics(tmp_path)) == 1, out.stdout[-2000:]
    assert (tmp_path / "checkpoint.pt").is_file()


HEAD = "import torch\nfrom common.tasks import sequences\nadd_arguments, model = sequences.add_arguments, sequences.model\n"
DATA = "datasets = sequences.datasets\n"
RAISE = HEAD + DATA + "def model(args):\n    raise {}\n"  # line 6: the task's raise
ITEMS = (
    HEAD
    + """class Items(torch.utils.data.Dataset):
    def __init__(self, real, count):
        self.real, self.count = real, count
    def __len__(self):
        return self.count
    def __getitem__(self, i):
        {}
        return self.real[i]
def datasets(args):
    train, test = sequences.datasets(args)
    return Items(train, {}), test
"""
)  # line 9: the data set's own line
HOSTILE = {  # a task file; what its one line must say; whether the run owned its folder (a traceback kept)
    "a missing package": (
        "import nosuchpackage_for_the_test\n",
        ["ModuleNotFoundError", "nosuchpackage", ":1,"],
        False,
    ),
    "an empty message": (RAISE.format("RuntimeError()"), ["error: RuntimeError (at", ":6, in model"], True),
    "a BaseException, many long lines": (
        RAISE.format("type('Odd', (BaseException,), {})('first\\n' + 'x' * 100000)"),
        ["Odd: first [...]", ":6, in model"],
        True,
    ),
    "a __str__ that fails": (
        HEAD + DATA + "class Bad(Exception):\n    def __str__(self):\n        return 1 / 0\n"
        "def model(args):\n    raise Bad()\n",
        ["Bad: (its message cannot be printed)", ":9, in model"],
        True,
    ),
    "a __len__ that overstates": (ITEMS.format("", 10**6), ["__len__ is 1000000", "IndexError"], False),
    "an error in a DataLoader worker": (
        ITEMS.format("assert torch.utils.data.get_worker_info() is None, f'item {i} is broken'", 256),
        ["AssertionError: item", ":10, in __getitem__"],
        True,
    ),
    "a DataLoader worker that dies": (
        ITEMS.format("torch.utils.data.get_worker_info() and __import__('os')._exit(3)", 256),
        ["DataLoader worker of this rank", "exit code 3", "a crash in it"],
        False,
    ),
    "sys.exit with lines of its own": (
        RAISE.format("SystemExit('gave up\\nbecause')"),
        ["error: SystemExit: gave up [...] (at", ":6, in model"],
        True,
    ),
    "sys.exit(0)": (RAISE.format("SystemExit(0)"), ["error: SystemExit: 0 (at", ":6, in model"], True),  # ended 0
    "sys.exit()": (RAISE.format("SystemExit()"), ["error: SystemExit (at", ":6, in model"], True),  # ended 0
    "sys.exit(1)": (RAISE.format("SystemExit(1)"), ["error: SystemExit: 1 (at", ":6, in model"], True),  # said none
    "a KeyboardInterrupt in the task": (
        RAISE.format("KeyboardInterrupt"),
        ["KeyboardInterrupt", "my_task.py:6"],
        True,  # model(): the run owns its folder by then
    ),
    "an option that repeats a stage flag": (
        HEAD + DATA + "def add_arguments(group):\n    group.add_argument('--lr', type=float)\n",
        ["--lr: conflicting option string", ", line 6", "rename it"],
        False,
    ),
    "a missing data file of its own": (
        HEAD + "def datasets(args):\n    return open('/nonexistent/tokens.csv')\n",
        ["FileNotFoundError", "/nonexistent/tokens.csv", ":5, in datasets"],
        True,
    ),
}
OPTION = (
    HEAD
    + DATA
    + "import datetime, enum\nclass Mode(enum.IntEnum):\n    A = 1\n"
    + ("def add_arguments(group):\n    sequences.add_arguments(group)\n    group.add_argument('--mode', default={})\n")
)
HOSTILE |= {
    "an Enum option": (OPTION.format("Mode.A"), ["--mode is a Mode", "a str, int, float, bool, None"], False),
    "a date option": (OPTION.format("datetime.date(2020, 1, 1)"), ["--mode is a date"], False),
    "a --task that is a FIFO": (None, ["--task", "my_task.py", "not a regular file", "give a task file"], False),
    "a --task that is /dev/zero": (None, ["--task /dev/zero", "not a regular file"], False),
}
EVERYDAY = {"a missing package", "sys.exit(0)"}  # the others: make test-all


@pytest.mark.parametrize("case", [c if c in EVERYDAY else pytest.param(c, marks=pytest.mark.slow) for c in HOSTILE])
def test_any_failure_is_one_line_naming_the_task_line(case, tmp_path):
    """Whatever the task raises, and wherever (its import, model(), a DataLoader worker): one `error:` line with
    the type, the message on one bounded line and the task file's line; the traceback kept in the output folder
    once the run owns it. A task's data file that is missing is no failed write ("free some space")."""
    source, words, kept = HOSTILE[case]
    task = Path("/dev/zero") if "zero" in case else tmp_path / "my_task.py"
    if "FIFO" in case:  # reading it blocked the run for ever
        os.mkfifo(task)
    elif source:
        task.write_text(source)
    extra = ["--loader", "classic", "--num-workers", 1] if "worker" in case else []
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1, *extra), timeout=HANG)
    line = one_error(out, *words)
    assert len(line) < 1000 and "free some space" not in line and "out-of-memory" not in line, line
    traceback = tmp_path / "out" / "traceback-rank0.txt"
    assert traceback.is_file() == kept and (not kept or "Traceback" in traceback.read_text()), line
    assert (not kept) or str(traceback) in line


def test_bf16_inputs_pass_the_data_check():
    """The fingerprint hashes each input's bytes: numpy, which it went through, has no bfloat16 (a traceback)."""
    items = [(torch.full((3,), float(i)), i % 2) for i in range(10)]
    bf16 = [(x.bfloat16(), y) for x, y in items]
    assert preflight.fingerprint(bf16) != preflight.fingerprint(items)
    assert preflight.fingerprint(bf16) == preflight.fingerprint(list(bf16))


def test_a_task_option_of_another_type_is_refused_at_start(tmp_path, monkeypatch):
    """An Enum (an IntEnum too, an int that no checkpoint loads) or a date: before, a traceback at the first save,
    or a checkpoint of its own called planted on resume."""
    task = tmp_path / "my_task.py"
    for default, kind in [("Mode.A", "Mode"), ("datetime.date(2020, 1, 1)", "date"), ("[1, (2, 'x')]", None)]:
        task.write_text(OPTION.format(default))
        args = cli.parse_args(["--task", str(task), "--output-dir", str(tmp_path)], [flags.add])[0]
        if kind is None:  # plain values, lists of them too, pass
            check.check_args(args)
            continue
        with pytest.raises(SystemExit):
            check.check_args(args)
        assert check.plain(args.mode) is False and kind == type(args.mode).__name__


@pytest.mark.parametrize("kind", ["a FIFO", pytest.param("/dev/zero", marks=pytest.mark.slow)])
def test_plan_refuses_a_doctor_file_that_would_block(kind, tmp_path):
    """`make plan`'s --doctor read a FIFO for ever, and /dev/zero until memory ran out."""
    path = Path("/dev/zero") if kind == "/dev/zero" else tmp_path / "doctor.json"
    if kind == "a FIFO":
        os.mkfifo(path)
    out = run([sys.executable, "tools/plan.py", *SMALL_PLAN, "--doctor", path], timeout=HANG)
    one_error(out, f"--doctor {path}", "not a regular file", "--bandwidth")


@pytest.mark.slow
def test_a_rank_that_fails_names_itself_to_the_others(tmp_path):
    """Rank 1's task fails after the ranks met: it says its own line, and rank 0, whose collective then fails,
    names rank 1 and its error instead of guessing (before: "killed (out of memory, ...)"). srun's ranks: torchrun
    would stop rank 0 itself."""
    task = tmp_path / "my_task.py"
    task.write_text(HEAD + DATA + "from common.environment import launcher\ndef model(args):\n    if launcher().rank:\n"
                    "        raise ValueError('no such layer')\n    return sequences.model(args)\n")  # fmt: skip
    codes, outs = srun_like(2, S03, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1))
    errors = [[line for line in out.splitlines() if line.startswith("error:")] for out in outs]
    assert codes[0] and codes[1] and len(errors[0]) == 1 and len(errors[1]) == 1, outs
    assert errors[1][0].startswith("error: rank 1: ValueError: no such layer") and f"{task}:8, in model" in errors[1][0]
    assert "failed: rank 1: ValueError: no such layer" in errors[0][0], errors[0]
    assert (tmp_path / "out" / "traceback-rank1.txt").is_file() and "Traceback" not in outs[0] + outs[1]


def raised(call):
    """The exception `call()` raises, its traceback with it."""
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def test_the_lessons_refusal_is_its_line_and_the_same_class_elsewhere_is_not(tmp_path):
    """A ValueError, TypeError or FileNotFoundError that a `raise` of the lesson raised says its message
    as the line. The same classes raised by the task's own code, by a builtin the lesson called (round() of
    a NaN) or inside torch on the lesson's behalf are failures: the fallback names the type and the place."""
    depth = raised(lambda: models.build("wideresnet", 3, 10, 32, 15))
    assert failure.refusal(depth) == "error: --depth 15: a WideResNet is 6n+4 layers deep, n >= 1 (10, 16, 22, 28, 40)"
    missing = raised(lambda: data.dataset(tmp_path, "mnist", train=True))
    assert isinstance(missing, FileNotFoundError) and failure.refusal(missing) == f"error: {missing}"
    assert f"mnist is not in {tmp_path / 'MNIST' / 'raw'}" in str(
        missing
    ) and f"prepare_data.py {tmp_path} mnist" in str(missing)
    task = tmp_path / "my_task.py"
    task.write_text(RAISE.format("ValueError('no such layer')"))
    for call, said in [
        (lambda: cli.load_task(task).model(None), f"error: ValueError: no such layer (at {task}:6, in model)"),
        (
            lambda: holdout.split(list(range(4)), float("nan"), 1),
            "error: ValueError: cannot convert float NaN to integer",
        ),
        (lambda: models.build("wideresnet", 3, 10, 32, 16, 0.5), "error: TypeError: empty(): argument 'size'"),
    ]:
        err = raised(call)
        assert failure.refusal(err) is None and failure.settle(err, rails.Guard()).startswith(said), err


def test_a_task_file_that_cannot_be_read_is_named_and_a_read_of_the_tasks_own_is_not(tmp_path):
    """cli.load_task() reads the file itself (once: the bytes that run are those the run records, not Python's
    loader): a --task that is missing or a folder is still named as the task file, and a file the task's own code
    fails to read as it loads is the task's failure, with its place."""
    reads = tmp_path / "reads.py"
    reads.write_text("from pathlib import Path\n\nPath('/nonexistent/x.bin').read_bytes()\n")
    for path, said in [
        (tmp_path / "missing.py", f"error: --task {tmp_path / 'missing.py'}: No such file or directory: give a task"),
        (tmp_path, f"error: --task {tmp_path}: Is a directory: give a task file"),
        (reads, "error: FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/x.bin' (at "),
    ]:
        line = failure.settle(raised(lambda path=path: cli.load_task(path)), rails.Guard())
        assert line.startswith(said), line
    assert f"(at {reads}:3, in <module>)" in line


def test_run_says_the_lessons_refusal_as_it_is_and_a_tasks_error_with_its_place(tmp_path, monkeypatch):
    """rails.run(): every rank that met the lesson's refusal says its line and ends together (as a
    SystemExit did); a ValueError of the task's own code keeps the fallback's type and place."""
    ended, closed = [], []
    monkeypatch.setattr(rails.signals, "stop_at_once", lambda: None)  # this test process keeps its handlers
    monkeypatch.setattr(rails, "end", lambda code, joined: ended.append(code))
    monkeypatch.setattr(rails.Guard, "close", lambda guard, together: closed.append(together))
    task = tmp_path / "my_task.py"
    task.write_text(RAISE.format("ValueError('no such layer')"))
    rails.run(lambda guard: holdout.split(list(range(4)), 0.01, 1))
    rails.run(lambda guard: cli.load_task(task).model(None))
    assert ended[0] == "error: a validation fraction of 0.01 of 4 images leaves a part empty"
    assert closed == [True, False]  # the refusal's ranks end together; the fallback's each alone
    assert ended[1].startswith(f"error: ValueError: no such layer (at {task}:6, in model)"), ended


def test_a_task_is_blamed_only_where_its_own_call_failed(tmp_path):
    """`model(args) returned ... not a torch.nn.Module` only for the stage's `task.model(args).to(device)`, and
    `the checkpoint does not match` only inside common/checkpoint.py: a batch of numpy arrays that a model's
    forward moves with .to(), and a model() loading weights of another shape, were both said so, with no place."""
    guard, task = rails.Guard(), SimpleNamespace(model=lambda args: {})
    guard.args = SimpleNamespace(task="my_task.py", output_dir=None)
    wrong = raised(lambda: task.model(None).to("cpu"))
    assert (
        failure.explain(wrong, guard) == "error: --task my_task.py: model(args) returned a dict, not a torch.nn.Module"
    )
    for err in [raised(lambda: numpy.zeros(3).to("cpu")),
                raised(lambda: torch.nn.Linear(2, 2).load_state_dict(torch.nn.Linear(3, 2).state_dict()))]:  # fmt: skip
        assert failure.explain(err, guard) is None and failure.settle(err, guard).startswith(
            f"error: {type(err).__name__}: "
        ), err
    torch.save({"model": torch.nn.Linear(3, 2).state_dict()}, tmp_path / "checkpoint.pt")
    mismatch = raised(lambda: resuming.restore(tmp_path / "checkpoint.pt", {"model": torch.nn.Linear(2, 2)}, None))
    assert failure.explain(mismatch, guard).startswith("error: the checkpoint does not match this model: ")


def test_explaining_that_fails_still_ends_in_one_line(monkeypatch):
    """explain() reads the error (its str(), its attributes): where that fails, the fallback's line still holds."""
    monkeypatch.setattr(failure, "explain", lambda err, guard: 1 / 0)
    try:
        raise ValueError("bad")
    except ValueError as err:
        assert failure.settle(err, rails.Guard()).startswith(f"error: ValueError: bad (at {__file__}:")


TOOLS = {  # each with its arguments and the stop it is sent
    "plot": (["runs-that-are-not-there"], signal.SIGINT), "scaling": (["runs-that-are-not-there"], signal.SIGINT),
    "plan": (SMALL_PLAN, signal.SIGINT), "prepare_data": ([".", "mnist"], signal.SIGTERM),
}  # fmt: skip


def test_a_stop_while_a_tool_imports_torch_is_one_line(tmp_path):
    """Ctrl-C in the seconds `make plot` (scaling, plan, data) takes to import torch was a KeyboardInterrupt
    traceback out of torch's imports; SIGTERM ended with no line. Now one line each and 128 + the signal."""
    tools = {}
    for name, (args, signum) in TOOLS.items():
        proc = subprocess.Popen([sys.executable, str(REPO / "tools" / f"{name}.py"), *args], env=clean_env(),
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        tools[name] = proc, signum
    for proc, signum in tools.values():
        wait_for(lambda proc=proc: "libtorch_cpu" in Path(f"/proc/{proc.pid}/maps").read_text(), 60, proc)
        proc.send_signal(signum)
        proc.send_signal(signum)  # pressed twice: the first counts
    for name, (proc, signum) in tools.items():
        stdout, stderr = proc.communicate(timeout=HANG)
        assert proc.returncode == 128 + signum and stdout == "", (name, proc.returncode, stdout, stderr)
        assert stderr == f"stopped by {signal.Signals(signum).name}: no file is left half-written\n", (name, stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # prepare_data made nothing yet


def test_a_stage_or_tool_started_in_a_deleted_folder_is_one_line(tmp_path):
    """A shell whose folder was deleted since (a scratch purge, `rm -r` from another shell): torch's import there
    printed "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so" and ended with status 2, naming no folder."""
    gone, said = tmp_path / "gone", "error: the folder this process started in has been deleted: cd to one that exists"
    said += " and run again\n"
    for script in (S01, REPO / "tools" / "plan.py", REPO / "tools" / "doctor.py"):
        gone.mkdir()
        start = 'cd "$1" && rmdir "$1" && exec "$2" "$3"'  # the shell stays in the folder it deleted
        out = run(["sh", "-c", start, "sh", str(gone), sys.executable, str(script)], cwd=tmp_path)
        assert out.returncode == 1 and out.stdout == "" and "oneMKL" not in out.stderr, (script, out.stderr)
        assert out.stderr == said, (script, out.stderr)


BREAK = """
import csv, runpy, sys
csv.DictReader = None  # a failure none of the tool's checks knows
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_an_error_no_check_of_a_tool_names_is_one_line(tmp_path):
    """Whatever a tool meets that none of its checks knows: one line, its place in the tool, the traceback kept in
    the temporary folder (TMPDIR), not printed."""
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "metrics.csv").write_text("epoch,world_size,epoch_seconds,images_per_s,test_accuracy\n1,1,2,3,4\n")
    out = run([sys.executable, "-c", BREAK, str(REPO / "tools/plot.py"), str(run_folder)],
              env=clean_env(TMPDIR=tmp_path))  # fmt: skip
    kept = next(tmp_path.glob("traceback-plot-*.txt"), None)  # traceback-<tool>-<pid>.txt
    assert out.returncode == 1 and out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: TypeError: 'NoneType' object is not callable (at "), out.stderr
    assert "tools/plot.py:" in out.stderr and out.stderr.endswith(
        f"; the traceback is in {kept}: plot met what none of its checks knows\n"
    ), out.stderr
    assert "Traceback (most recent call last)" in kept.read_text() and "csv.DictReader" in kept.read_text()


def test_a_tool_whose_reader_goes_ends_as_after_sigpipe_with_no_line(tmp_path):
    """`make plan ... | head -3`: the write after head ended was "error: BrokenPipeError ... plan met what none of
    its checks knows" and a traceback file; stage_diff.py's was a traceback, and its --help printed the diffs."""
    piped = (
        "from common.guards import early\ndef main():\n    raise BrokenPipeError(32, 'Broken pipe')\nearly.run(main)"
    )
    out = run([sys.executable, "-c", piped], cwd=REPO, env=clean_env(TMPDIR=tmp_path))
    assert out.returncode == 128 + signal.SIGPIPE and out.stderr == "" and not list(tmp_path.iterdir()), out.stderr
    proc = subprocess.Popen(
        [sys.executable, REPO / "tools/stage_diff.py"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # its reader gone before it writes: the first write meets the broken pipe
    assert proc.wait(timeout=HANG) == 128 + signal.SIGPIPE and proc.stderr.read() == b""
    helped = run([sys.executable, REPO / "tools/stage_diff.py", "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("What each stage adds") and "====" not in helped.stdout


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["01_single_gpu", "02_dataparallel"])
def test_a_stage_of_one_process_launched_as_two_ranks_is_one_line(stage, tiny_data, tmp_path):
    """Stages 01 and 02 under srun with two tasks (or torchrun with two): each rank trained the whole data set alone,
    and the lines and metrics.csv said world size 2, at half the speed per process. Refused before the first step."""
    codes, outputs = srun_like(2, REPO / stage / "train.py", *stage_args(tiny_data, tmp_path / "out", "--epochs", 1))
    said = [line for out in outputs for line in out.splitlines() if line.startswith("error:")]
    assert codes == [1, 1] and len(said) == 1, outputs
    assert said[0].startswith("error: this stage trains one copy of the model in one process, and 2 ranks were")
    assert "stage 03 for 2" in said[0] and not any("epoch   1" in out for out in outputs), outputs


@pytest.mark.slow
def test_a_failure_every_rank_meets_is_said_once(tmp_path):
    """A task's file missing on every rank printed one line per rank: at 512 ranks, 512 copies to scroll through.
    Rank 0 says it once, "on every rank"; the others say nothing and end as failed."""
    task = tmp_path / "missing.py"
    head = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom common.tasks.images import model  # noqa\n\n\n"
    task.write_text(head + "def datasets(args):\n    open('/nonexistent/file.bin')\n")
    out = torchrun(2, S03, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1))
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]
    assert out.returncode and len(errors) == 1, errors
    assert errors[0].startswith("error: on every rank: FileNotFoundError") and f"{task}:7, in datasets" in errors[0]
