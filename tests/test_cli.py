"""The command line: bounds on every option, one-line usage errors from one rank, the options a run is
defined by, and `python -m common.guards.check` as the job scripts' check before torchrun."""

import hashlib
import inspect
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import HANG, REPO, S01, S03, S05, clean_env, run

from common import cli, environment
from common.guards import check, options, preflight, rails, recorded, sources
from common.options import flags

LAUNCHER = ("RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_JOB_ID")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """The tests set the launcher variables they need, whatever ran pytest."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)


def parse(argv, warn=True):
    """The options as a stage takes them: the parser (common/cli.py), then the guard rails' own checks
    (a usage error the parser raises is one line, check.parse_args(), and so is a number out of range)."""
    args, _ = check.parse_args(argv)
    check.check_args(args, warn, argv=argv)
    return args


def refused(argv, capsys):
    """stderr of a parse that must fail as a usage error: exit status 2."""
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


BAD = [
    ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-inf"), ("--lr", "0"), ("--lr", "1e400"),
    ("--gamma", "0"), ("--gamma", "1.01"), ("--gamma", "nan"),
    ("--seed", str(2**70)), ("--seed", str(2**32)), ("--seed", "-1"), ("--seed", "1.5"),
    ("--momentum", "1"), ("--momentum", "-0.1"), ("--momentum", "nan"),
    ("--weight-decay", "-1e-4"), ("--weight-decay", "inf"), ("--weight-decay", "nan"), ("--weight-decay", "1e39"),
    ("--lr", "1e39"),  # past float32's range: the optimizer's update would overflow
    ("--target", "nan"), ("--target", "inf"), ("--target", "-inf"),
    ("--val-fraction", "1"), ("--val-fraction", "-0.1"), ("--val-fraction", "nan"),
    ("--epochs", "0"), ("--epochs", "1e3"), ("--batch-size", "-64"), ("--test-batch-size", "0"),
    ("--batch-size", str(2**63)), ("--test-batch-size", str(10**20)),  # past islice()'s: a late ValueError
    ("--log-interval", "0"), ("--patience", "0"), ("--step-size", "0"), ("--depth", "0"), ("--width", "0"),
    ("--dist-timeout", "0"), ("--dist-timeout", "86401"), ("--num-workers", "-1"), ("--num-workers", "two"),
]  # fmt: skip


NOT_NUMBERS = {("--seed", "1.5"), ("--epochs", "1e3"), ("--num-workers", "two")}  # the parser's type= refuses


@pytest.mark.parametrize("flag, value", BAD)
def test_bad_value_is_one_line_naming_the_flag(flag, value, capsys):
    err = refused([f"{flag}={value}"], capsys)  # "=": argparse reads a lone -1e-4 or -inf as an option
    said = f"invalid int value: '{value}'" if (flag, value) in NOT_NUMBERS else "must be "
    assert err.startswith(f"error: argument {flag}: {said}"), err
    assert err.endswith("(see --help)\n") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--momentum", "0.9"], "argument --momentum: adadelta has none (sgd's and rmsprop's)"),
        (["--optimizer", "adam", "--momentum", "0.5"], "argument --momentum: adam has none"),
        (["--scheduler", "cosine", "--step-size", "2"], "argument --step-size: the cosine schedule takes no steps"),
        (["--scheduler", "cosine", "--gamma", "0.5"], "argument --gamma: the cosine schedule has no decay factor"),
    ],
)
def test_a_recipe_flag_the_recipe_never_reads_is_refused(argv, said, capsys):
    """--momentum with adadelta or adam, --step-size or --gamma with the cosine schedule: parsed, recorded and
    trained without, a plausible number for a recipe that was not run. One line instead; where the recipe reads it,
    or it is left at its default, it runs."""
    err = refused(argv, capsys)
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err
    parse(["--optimizer", "rmsprop", "--lr", "0.01", "--momentum", "0.9", "--scheduler", "cosine", "--step-size", "1"])


SGD_BY_DEFAULT = """
from common.tasks.images import add_arguments as images, check, datasets, model


def add_arguments(group):
    images(group)
    group.set_defaults(optimizer="sgd", momentum=0.9, lr=0.05)
"""


def test_a_recipe_value_a_task_sets_and_its_optimizer_never_reads_runs_and_is_not_recorded(tmp_path, capsys):
    """A task's default `momentum=0.9` (for its sgd) with `--optimizer adam`: refused as `argument --momentum`, a
    flag the user never typed. It runs now, recorded without it; typed, alone or with `=`, it is still
    refused. A run recorded with an unread --momentum (before such values were left out) resumes without it."""
    task = tmp_path / "task.py"
    task.write_text(SGD_BY_DEFAULT)
    args = parse(["--task", str(task), "--optimizer", "adam"])
    assert (args.optimizer, args.momentum) == ("adam", 0.9) and "momentum" not in preflight.defining(args)
    for typed in (["--momentum", "0.9"], ["--momentum=0.9"]):  # a prefix, --mom, is no flag at all
        err = refused(["--task", str(task), "--optimizer", "adam", *typed], capsys)
        assert err.startswith("error: argument --momentum: adam has none"), (typed, err)
    older = {"flags": preflight.defining(parse([])) | {"momentum": 0.9}}  # an adadelta run that recorded it
    state = {"epoch": 1, "step": 0}
    assert recorded.mismatch(older, state, parse([]), {}) is None
    assert "--lr 1.0 (now 0.5)" in recorded.mismatch(older, state, parse(["--lr", "0.5"]), {})  # the rest compared


RATE_BY_THE_TASK = """
from common.tasks.images import add_arguments as images, check, datasets, model


def add_arguments(group):
    images(group)
    group.add_argument("--lr-warmup", type=float, default=0.0)  # a task's flag that --lr is a prefix of
    group.set_defaults(optimizer="{}"{})
"""


@pytest.mark.parametrize(
    "name, argv, task",
    [
        ("adam", ["--optimizer", "adam"], "adadelta"),
        ("sgd", ["--optimizer=sgd", "--lr-scaling", "sqrt"], "adadelta"),
        ("rmsprop", ["--optimizer", "rmsprop", "--lr-warmup", "1.0"], "adadelta"),
        ("adam", [], "adam"),  # the task's default optimizer, at no rate of its own
    ],
)
def test_another_optimizer_at_adadeltas_rate_nobody_gave_is_refused(name, argv, task, tmp_path, capsys):
    """--optimizer adam (or rmsprop, sgd; a flag's or the task's) without --lr trained at the lesson's 1.0, Adadelta's
    rate: Adam's loss in the millions, logged and saved as a run. One line naming the optimizer's own default rate;
    a rate typed, 1.0 too, or the task's own, runs."""
    path = tmp_path / "task.py"
    path.write_text(RATE_BY_THE_TASK.format(task, ""))
    err = refused(["--task", str(path), *argv], capsys)
    assert err == (
        f"error: argument --optimizer: {name} at --lr's default, 1.0, which is Adadelta's rate: give {name}'s own with "
        f"--lr (torch's default for it: {options.TORCH_LR[name]:g}) (see --help)\n"
    )
    for rate, lr in ((["--lr", "1.0"], 1.0), (["--lr=0.001"], 0.001), (["--lr", "0.5", "--lr-warmup", "1"], 0.5)):
        assert parse(["--task", str(path), *argv, *rate]).lr == lr
    path.write_text(RATE_BY_THE_TASK.format(task, ", lr=0.01"))
    assert parse(["--task", str(path), *argv]).lr == 0.01
    assert parse(["--optimizer", "adadelta"]).lr == options.LESSON_LR == cli.parser(S01).get_default("lr")
    optimizers = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop, "sgd": torch.optim.SGD}
    assert options.TORCH_LR == {k: inspect.signature(c).parameters["lr"].default for k, c in optimizers.items()}


def test_a_tasks_own_optimizer_at_adadeltas_rate_nobody_gave_is_refused(tmp_path):
    """The recipe example's AdamW (a task's optimizer()), run as its docstring said, without --lr: it trained at the
    lesson's 1.0, Adadelta's rate, and scored chance (24 % of 4 classes), unsaid. One line naming the class and its
    own default, as for --optimizer's; a warm-up's first factor of 0 changes nothing; a rate typed, Adadelta's own
    class, or a class whose default is 1.0 runs."""
    weights = [torch.nn.Parameter(torch.zeros(2))]
    adamw = torch.optim.AdamW(weights, lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.0)  # a warm-up: the group's lr is 0 from here
    args = SimpleNamespace(lr=1.0)
    said = options.unset_task_rate(adamw, args, [])
    assert said == (
        "argument --lr: the task's AdamW at --lr's default, 1.0, which is Adadelta's rate: give its own with --lr "
        "(torch's default for it: 0.001)"
    )
    assert options.unset_task_rate(adamw, args, ["--lr", "1"]) is None
    assert options.unset_task_rate(torch.optim.Adadelta(weights), args, []) is None
    assert options.unset_task_rate(torch.optim.AdamW(weights, lr=0.003), args, []) is None
    out = run([sys.executable, str(S01), "--task", str(REPO / "common/tasks/examples/recipe.py"), "--epochs", "1",
               "--clip-grad", "1", "--output-dir", str(tmp_path), "--samples", "64"], timeout=HANG)  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith("error: argument --lr: the task's AdamW at --lr's default")
    assert out.stderr.count("\n") == 1, out.stderr


def test_every_number_has_a_range():
    """Every option read as a number, of the stages and of each built-in task, has its range in the guard rails
    (common/guards/options.py), which check it: nan, inf, zero epochs never reach a run."""
    numbers = set()
    for task in [None, *sorted((cli.REPO / "common" / "tasks").glob("*.py"))]:
        p = cli.parser(S05, [flags.add, flags.large])
        if task is not None and hasattr(loaded := cli.load_task(task), "add_arguments"):
            loaded.add_arguments(p)
        numbers |= {action.dest for action in p._actions if action.type in (int, float)}
    assert "dim" in numbers and numbers == set(options.RANGES)


@pytest.mark.parametrize(
    "flag, value, parsed",
    [("--lr", "1e30", 1e30), ("--gamma", "1", 1.0), ("--seed", str(2**32 - 1), 2**32 - 1), ("--seed", "0", 0),
     ("--momentum", "0", 0.0), ("--target", "1e30", 1e30), ("--val-fraction", "0", 0.0),
     ("--dist-timeout", "86400", 86400), ("--num-workers", "0", 0)],
)  # fmt: skip
def test_edge_values_are_accepted(flag, value, parsed):
    assert getattr(parse([flag, value]), flag[2:].replace("-", "_")) == parsed


@pytest.mark.parametrize(
    "argv, text",
    [(["--model", "net", "--dataset", "cifar10"], "--model net is tested with --dataset"),
     (["--loader", "fast"], "argument --loader: invalid choice"), (["--lr"], "argument --lr: expected one argument"),
     (["--learning-rate", "1"], "unrecognized arguments: --learning-rate")],
)  # fmt: skip
def test_other_usage_errors_are_one_line(argv, text, capsys):
    err = refused(argv, capsys)
    assert err.startswith(f"error: {text}") and err.count("\n") == 1


def test_stage_refuses_nan_in_one_line():
    out = run([sys.executable, "01_single_gpu/train.py", "--lr", "nan"], env=clean_env(), timeout=HANG)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    # refused before any data is read: argparse's line, not the data's (no clock: a busy machine is slow)
    assert out.stderr.splitlines() == ["error: argument --lr: must be a number in (0, 3.4e38], got nan (see --help)"]


@pytest.mark.parametrize(
    "env, prints",
    [({"TORCHELASTIC_RUN_ID": "x", "RANK": "1"}, False), ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, True),
     ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, False), ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, True),
     # srun torchrun: torchrun's global rank decides, not the srun task's
     ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, True),
     ({"SLURM_PROCID": "1"}, True),  # the batch shell: no step, no launcher
     ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "a1"}, True),  # a rank unread (refused next): nobody else reports
     ({"RANK": "1"}, True)],  # a manual launch: nobody else reports
)  # fmt: skip
def test_only_rank_0_of_a_launcher_reports(env, prints, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bool(refused(["--lr", "nan"], capsys)) == prints
    assert parse(["--num-workers", "1000"]).num_workers <= len(os.sched_getaffinity(0))
    assert bool(capsys.readouterr().err) == prints


def test_num_workers_capped_by_cpus_per_rank(monkeypatch, capsys):
    assert parse(["--num-workers", "1000"]).num_workers == len(os.sched_getaffinity(0))  # this machine
    assert capsys.readouterr().err.startswith("warning: --num-workers 1000 is more than")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks share the eight CPUs
    assert parse(["--num-workers", "1000"]).num_workers == 4
    assert capsys.readouterr().err.count("\n") == 1
    assert parse(["--num-workers", "4"]).num_workers == 4
    assert parse([]).num_workers is None  # the loader's own default
    assert capsys.readouterr().err == ""
    # an srun step that got 2 CPUs of --cpus-per-task=8 (Slurm 22.05-23.02 without SRUN_CPUS_PER_TASK): its 2, which
    # the doctor passed as 8 while its next line warned of 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert environment.cpus_per_rank() == 2 and parse(["--num-workers", "4"]).num_workers == 2


def test_every_option_is_classified():
    p = cli.parser(S05, [flags.add, flags.large])
    cli.load_task(cli.TASK).add_arguments(p)  # the built-in task's own options
    dests = [action.dest for action in p._actions if action.dest != "help"]
    assert not set(options.DEFINING) & set(options.FREE)
    assert len(options.DEFINING + options.FREE) == len(set(options.DEFINING + options.FREE))
    assert set(dests) == set(options.DEFINING) | set(options.FREE)


def test_defining_values_and_the_cosine_rule():
    step = preflight.defining(parse(["--epochs", "3"]))
    held = hashlib.sha256(cli.TASK.read_bytes()).hexdigest()[:16]  # the task by what it holds, not its name alone
    assert step["lr"] == 1.0 and step["dataset"] == "mnist" and step["task"] == f"images.py (sha256 {held})"
    # the built-in task's options among them; adadelta reads no --momentum (options.used())
    # --grad-accum: stage 05's alone, recorded by every stage as it runs without it (one micro-batch)
    assert set(step) == set(options.DEFINING) - {"momentum"} and step["grad_accum"] == 1
    large, _ = check.parse_args(["--grad-accum", "2"], [flags.large])  # stage 05's: its slices draw their own dropout
    assert preflight.defining(large)["grad_accum"] == 2 and set(preflight.defining(large)) == set(step)
    cosine = preflight.defining(parse(["--epochs", "3", "--scheduler", "cosine"]))
    assert cosine == {k: v for k, v in step.items() if k not in ("step_size", "gamma")} | {
        "scheduler": "cosine",
        "epochs": 3,
    }
    assert preflight.defining(parse(["--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9"]))["momentum"] == 0.9
    assert all(type(value) in (str, int, float, bool, type(None)) for value in cosine.values())  # weights_only loads


def test_a_resume_names_the_options_that_changed_and_none_that_did_not():
    """A run under the cosine schedule resumed under --scheduler step: it named `--epochs 2 (now None)` beside the
    scheduler, --epochs being defining under cosine alone; an option no longer defining is shown by its value."""
    run = {"flags": preflight.defining(parse(["--epochs", "2", "--scheduler", "cosine"]))}
    said = recorded.differs(run, parse(["--epochs", "2"]), {})
    assert said.startswith("was written with --scheduler cosine (now step): resume with the same options"), said
    said = recorded.differs(run, parse(["--epochs", "3"]), {})
    assert said.startswith("was written with --scheduler cosine (now step), --epochs 2 (now 3):"), said


def test_a_resume_compares_grad_accum_and_the_task_by_what_it_holds(tmp_path, capsys):
    """--grad-accum was free, yet each slice draws its own dropout masks (a resume with another value trains other
    numbers); the task was recorded by its base name, so another t.py (a label-smoothing loss) resumed
    silently. Both are compared now, each named with both values; a run recorded before the task's hash was
    compares its name; and a resume at another world size says so in one line."""
    task = cli.TASK.read_text()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "t.py").write_text(task)
    (tmp_path / "b" / "t.py").write_text(task.replace("def datasets", "# label smoothing\ndef datasets"))
    was, _ = check.parse_args(["--task", str(tmp_path / "a" / "t.py"), "--grad-accum", "2"], [flags.large])
    run, state = {"flags": preflight.defining(was)}, {"epoch": 1, "step": 0}
    assert recorded.mismatch(run, state, was, {}) is None
    now, _ = check.parse_args(["--task", str(tmp_path / "a" / "t.py"), "--grad-accum", "4"], [flags.large])
    assert "was written with --grad-accum 2 (now 4)" in recorded.mismatch(run, state, now, {})
    other, _ = check.parse_args(["--task", str(tmp_path / "b" / "t.py"), "--grad-accum", "2"], [flags.large])
    differs = recorded.mismatch(run, state, other, {})
    assert differs.startswith("was written with --task t.py (sha256 ") and "(now t.py (sha256 " in differs
    older = {"flags": preflight.defining(was) | {"task": "t.py"}}  # recorded by its name alone
    assert recorded.mismatch(older, state, other, {}) is None
    recorded.say_world({"world": 2}, {"world": 1})
    recorded.say_world({"world": 2}, {"world": 2})
    assert capsys.readouterr().out == "resumed at world size 1 from 2: the same samples, not bit-identical\n"
    # stage 05 at the same world size on another mesh (2 nodes x 2 ranks, then 4 on one node, or --full-shard):
    # other sums in other orders, and it said nothing; a run recorded before the mesh was says nothing either
    recorded.say_world({"world": 4, "mesh": [2, 2]}, {"world": 4, "mesh": [4]})
    recorded.say_world({"world": 4, "mesh": [2, 2]}, {"world": 4, "mesh": [2, 2]})
    recorded.say_world({"world": 4}, {"world": 4, "mesh": [4]})
    assert capsys.readouterr().out == "resumed on a mesh of 4 from 2 x 2: the same samples, not bit-identical\n"


def test_the_paths_are_absolute_before_the_tasks_code_runs(tmp_path, monkeypatch):
    """A relative --output-dir was resolved again at every write: a task that changes directory (as its module is
    read, or later in datasets()) had its checkpoints written under the new one, without manifest or lock. The
    parser makes --output-dir, --resume, --data-dir and --task absolute where the run starts, before the task's
    code runs."""
    (tmp_path / "away").mkdir()
    (tmp_path / "t.py").write_text(
        f"import os\nfrom common.tasks.images import *  # noqa: F403\nos.chdir({str(tmp_path / 'away')!r})\n"
    )
    monkeypatch.chdir(tmp_path)
    args, _ = cli.parse_args(["--task", "t.py", "--output-dir", "out", "--resume", "c.pt", "--data-dir", "d"])
    assert Path.cwd() == tmp_path / "away"  # the task's module moved the process
    assert (args.output_dir, args.resume, args.data_dir, args.task) == tuple(
        tmp_path / n for n in ("out", "c.pt", "d", "t.py")
    )


def test_default_output_dirs_differ():
    """Two runs started in the same second, outside Slurm and torchrun, get folders of their own."""
    code = "from pathlib import Path; from common import cli; print(cli.default_output_dir(Path('01_single_gpu/t.py')))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=clean_env(), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    names = [Path(p.communicate(timeout=HANG)[0].strip()).name for p in procs]
    assert names[0] != names[1] and all(name.startswith("local-") for name in names)
    script = Path("01_single_gpu/train.py")
    assert cli.default_output_dir(script, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"}).name == "7_2"
    assert cli.default_output_dir(script, {"TORCHELASTIC_RUN_ID": "abc"}).name == "torchrun-abc"


def test_resume_needs_a_regular_file(tmp_path, monkeypatch, capsys):
    os.mkfifo(tmp_path / "fifo")  # torch.load would wait on it forever
    for path, what in ((tmp_path / "fifo", "is not a regular file"), (tmp_path, "is a directory"),
                       (tmp_path / "none.pt", "does not exist")):  # fmt: skip
        err = refused(["--resume", str(path)], capsys)
        assert err.startswith(f"error: argument --resume: {path} {what}") and err.count("\n") == 1
    (tmp_path / "checkpoint.pt").touch()
    assert parse(["--resume", str(tmp_path / "checkpoint.pt")]).resume == tmp_path / "checkpoint.pt"
    assert parse(["--resume"]).resume is True
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "1")  # rank 0 reads the file: another node need not have it
    assert parse(["--resume", str(tmp_path / "none.pt")]).resume == tmp_path / "none.pt"


@pytest.mark.parametrize(
    "argv, flag",
    [(["--output-dir", ""], "--output-dir"), (["--data-dir= "], "--data-dir"), (["--resume", "", "--epochs", "1"], "--resume")],
)  # fmt: skip
def test_an_empty_path_is_refused_not_made_the_folder_the_run_starts_in(argv, flag):
    """`--output-dir "$OUT"` with OUT unset: the parser made it the current folder, and a run wrote its checkpoints
    there. The job scripts' check and the stages (test_a_stage_given_an_empty_output_dir_writes_nothing_where_it_starts) refuse it in one line."""
    out = run([sys.executable, "-m", "common.guards.check", *argv], timeout=HANG)
    said = f"error: argument {flag}: an empty path (an unset variable?): give the path itself (see --help)\n"
    assert out.returncode == 2 and out.stderr == said, out.stderr
    assert check.empty_path(["--output-dir", "runs", "--resume"]) is None


@pytest.mark.parametrize(
    "argv", [["--out", "/tmp/x"], ["--bat", "256"], ["--b=256"], ["--ta", "t.py"], ["--output", ""]]
)
def test_a_prefix_of_a_flag_is_refused_not_taken_for_it(argv):
    """argparse took a prefix for the flag it begins (--out for --output-dir): the batch-size sweep's own --batch-size
    and --output-dir, before "$@", lost to `--b 256 --out x` (bs64 trained at 256, written elsewhere), and every check
    that reads the command line had to guess which flag argparse would take. A flag is typed in full."""
    out = run([sys.executable, "-m", "common.guards.check", *argv], timeout=HANG)
    assert out.returncode == 2 and out.stderr == f"error: unrecognized arguments: {' '.join(argv)} (see --help)\n"
    assert options.given(["--lr", "0.1", "--lr-scaling=sqrt"], "--lr-scaling") == ["sqrt"]  # not --lr's 0.1


@pytest.mark.slow
def test_a_stage_given_an_empty_output_dir_writes_nothing_where_it_starts(tiny_data, tmp_path):
    out = run(
        [sys.executable, str(S01), "--data-dir", str(tiny_data), "--output-dir", "", "--epochs", "1"], cwd=tmp_path
    )
    assert out.returncode == 2 and "error: argument --output-dir: an empty path" in out.stderr, out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # before: .lock, checkpoint.pt, metrics.csv and the manifest, here


def test_a_task_is_recorded_with_the_modules_of_its_own_it_imports(tmp_path, monkeypatch):
    """A helper file the task imports, changed between a run and its resume, was resumed silently: the task was
    recorded by its own file alone. Its author's modules count; Python's, an installed
    package's and common/'s do not."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "helper_cfg_a1.py").write_text("ACT = 'relu'\n")
    (tmp_path / "t.py").write_text("import numpy, json\nimport helper_cfg_a1\nfrom common.tasks.images import *\n")
    try:
        task = cli.load_task(tmp_path / "t.py")
        first = sources.with_own_modules(task)
        assert first == task.__source__ + b"helper_cfg_a1.py" + b"ACT = 'relu'\n"
        (tmp_path / "helper_cfg_a1.py").write_text("ACT = 'tanh'\n")
        assert sources.with_own_modules(task) != first
    finally:
        sys.modules.pop("helper_cfg_a1", None)


def test_a_task_is_recorded_with_its_own_modules_however_it_imports_them(tmp_path, monkeypatch):
    """Only helpers the task held as modules or classes counted: a value imported from a helper (`from cfg import
    SMOOTH`, a label smoothing), an import inside loss(), a helper's own imports and `import pkg.sub` (which binds
    pkg alone) were left out, and a run resumed silently with other numbers after any of them changed."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pkg_b2").mkdir()
    files = {
        "cfg_b2.py": "import deep_b2\nSMOOTH = 0.0\n",  # a value; and a helper's own import
        "deep_b2.py": "SCALE = 1\n",
        "later_b2.py": "WIDTH = 8\n",  # imported in a function that has not run yet
        "pkg_b2/__init__.py": "",
        "pkg_b2/sub.py": "DEPTH = 2\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    task_file = tmp_path / "t.py"
    task_file.write_text(
        "import json\nimport numpy\nimport pkg_b2.sub\nfrom cfg_b2 import SMOOTH\nfrom common.tasks.images import *\n"
        "def loss(output, target):\n    import later_b2\n    return later_b2.WIDTH\n"
    )
    try:
        task = cli.load_task(task_file)
        first = sources.with_own_modules(task)
        assert b"numpy" not in first.replace(task.__source__, b"") and b"images.py" not in first
        for name, text in files.items():
            (tmp_path / name).write_text(text + "# changed\n")
            assert sources.with_own_modules(task) != first, name
            (tmp_path / name).write_text(text)
        assert sources.with_own_modules(task) == first
    finally:
        for name in ("cfg_b2", "deep_b2", "later_b2", "pkg_b2", "pkg_b2.sub"):
            sys.modules.pop(name, None)


def test_module_checks_arguments_fast_without_torch():
    """Fast because it imports no torch (checked below), not by a clock, which a busy machine would break."""
    bad = run([sys.executable, "-m", "common.guards.check", "--lr", "nan"], timeout=HANG)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--lr" in bad.stderr and not bad.stdout
    good = run([sys.executable, "-m", "common.guards.check", "--epochs", "1", "--num-workers", "1000"], timeout=HANG)
    assert (good.returncode, good.stdout, good.stderr) == (0, "", "")  # silent: the workers warn themselves
    code = "import sys, common.guards.check; sys.exit('torch' in sys.modules)"
    assert run([sys.executable, "-c", code], timeout=HANG).returncode == 0


@pytest.mark.parametrize(
    "bad, said",
    [({"SLURM_JOB_NODELIST": "node[a-b]"}, "cannot read the Slurm hostlist 'node[a-b]'"),
     ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
     ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer in [1, 65535]")],
    ids=["a hostlist", "a rank", "a port"],
)  # fmt: skip
def test_the_job_scripts_check_refuses_a_bad_launcher_variable_in_one_line(bad, said):
    """A usage error asks whether this is rank 0, which reads the launcher's variables: an unreadable hostlist was
    a traceback, a rank of `x` an exit 2 with no line at all, and a bad port passed."""
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
            "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n1"}  # fmt: skip
    out = run(
        [sys.executable, "-m", "common.guards.check", "--epochs", "0"], env=clean_env(**(srun | bad)), timeout=HANG
    )
    assert out.returncode == 1 and out.stderr.startswith(f"error: {said}") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.slow
def test_check_validates_a_stages_own_options_from_any_folder(tmp_path):
    """`train.py --check ARGS`, the pre-check before torchrun: stage 05 accepts its own flags, stage 03
    refuses them in one line, from a folder outside the repository."""
    ok = run([sys.executable, S05, "--check", "--grad-accum", "2"], cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout == "" and ok.stderr == "", ok.stderr
    refused = run([sys.executable, S03, "--check", "--grad-accum", "2"], cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --grad-accum is taught in stage 05_fsdp")


def test_a_learning_rate_that_scaling_takes_past_float32_is_refused(capsys):
    err = refused(["--lr", "1e37", "--lr-scaling", "linear", "--batch-size", "6400"], capsys)
    assert err == "error: --lr 1e+37 scaled to --batch-size 6400 (linear) overflows float32 (see --help)\n"


def test_the_default_output_folder_stays_inside_runs_whatever_the_variables_hold(tmp_path):
    script = tmp_path / "03_ddp_single_node" / "train.py"
    runs = tmp_path / "runs" / "03_ddp_single_node"
    for env in ({"SLURM_JOB_ID": "../../x"}, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "/../../y"},
                {"TORCHELASTIC_RUN_ID": "../z"}, {"SLURM_JOB_ID": ".."}, {"SLURM_JOB_ID": "."}):  # fmt: skip
        folder = cli.default_output_dir(script, env)
        assert folder.parent == runs and folder.name not in (".", "..") and "/" not in folder.name, (env, folder)
        assert folder.resolve().parent == runs.resolve(), (env, folder)


@pytest.mark.parametrize("after", ["os.remove(__file__)", "open(__file__, 'a').write('# edited')"])
def test_the_task_is_recorded_by_the_bytes_that_ran(tiny_data, tmp_path, after):
    """A task file that deletes itself once loaded (or is edited after): the manifest's hash read the file again,
    a FileNotFoundError in one generic line (or the hash of bytes that never ran). The file is read once: the bytes
    that run are the bytes hashed."""
    source = f"import os\nfrom common.tasks.images import *  # noqa: F403\n{after}\n"
    (tmp_path / "t.py").write_text(source)
    args, task = check.parse_args(["--task", str(tmp_path / "t.py"), "--data-dir", str(tiny_data), "--no-cuda"])
    guard = rails.Guard()
    guard.args = args
    train_set, test_set = task.datasets(args)
    guard.agree(train_set, [], test_set, task)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert preflight.defining(guard.args)["task"] == f"t.py (sha256 {digest})"


def test_a_flag_of_stage_05_alone_is_recorded_as_the_other_stages_run_without_it():
    """--grad-accum is stage 05's alone: stages 01-04 recorded nothing of it, and a stage 01 run resumed in stage 05
    with --grad-accum 2 went on without a word, to other numbers (65.82 % where the run reached 67.38 %)."""
    one, _ = check.parse_args([])
    five, _ = check.parse_args(["--grad-accum", "2"], [flags.large])
    said = recorded.differs({"flags": preflight.defining(one)}, five, {})
    assert said == "was written with --grad-accum 1 (now 2): resume with the same options, or use another --output-dir"
    assert recorded.differs({"flags": preflight.defining(one)}, check.parse_args([], [flags.large])[0], {}) is None
    said = recorded.differs({"flags": preflight.defining(five)}, one, {})  # and back in stage 03: one micro-batch
    assert said.startswith("was written with --grad-accum 2 (now 1):"), said


def test_a_tasks_own_scheduler_makes_epochs_define_the_run(tmp_path):
    """The recipe example's per-step cosine decays to 0 over --epochs: resumed with --epochs 3 after 2, its rate went
    up again (95.31 % where the uninterrupted run reached 98.83 %), accepted without a word. The stage's own
    schedule is refused so under cosine alone: StepLR goes on by epochs, whatever their number."""
    args = parse(["--epochs", "2"])
    for scheduled in (False, True):
        args.task = preflight.Task.loaded(tmp_path / "t.py", b"source", scheduled=scheduled)
        assert preflight.defining(args).get("epochs") == (2 if scheduled else None)
    recorded_run = {"flags": preflight.defining(args)}
    args.epochs = 3
    assert "was written with --epochs 2 (now 3)" in recorded.differs(recorded_run, args, {})


def test_the_tasks_path_is_made_as_pathlib_makes_the_paths_it_derives(tmp_path):
    """Python 3.12's pathlib passes a Path subclass's every constructor argument to Path, and derives a path
    (`.parent`, `/`) by `type(self)(*segments)`: a task path made of (path, source) refused its own bytes, and every
    run of every stage on Python 3.12 ended at its start in a TypeError (an H200 with Python 3.12, 2026-11-30)."""
    task = preflight.Task.loaded(tmp_path / "t.py", b"source")
    assert task.source == b"source" and task == tmp_path / "t.py"
    assert type(task)(str(task)) == task and type(task)(str(tmp_path), "t.py") == task  # 3.12's with_segments


TYPED = """from __future__ import annotations

import dataclasses
from typing import ClassVar

from common.tasks.images import *  # noqa: F403


@dataclasses.dataclass
class Crop:
    size: int = 24
    kinds: ClassVar[tuple] = ("centre", "random")
"""


def test_a_tasks_own_classes_are_found_by_their_module(tmp_path):
    """A task with a dataclass under `from __future__ import annotations` was an AttributeError of dataclasses'
    own (it looks its module up in sys.modules, where the task was not), and its objects could not be pickled
    (DataLoader workers started by spawn or forkserver pickle the data set)."""
    (tmp_path / "typed.py").write_text(TYPED)
    task = cli.load_task(tmp_path / "typed.py")
    crop = pickle.loads(pickle.dumps(task.Crop(20)))
    assert crop == task.Crop(20) and task.Crop.kinds == ("centre", "random")
