"""The workshop flags: optimizers, schedules, the learning-rate rule, early stopping, validation."""

import inspect
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, S03, launched, metrics, run, stage_args

from common import cli, optim
from common.options import flags, hooks, recipes


def args(**kw):
    defaults = dict(lr=1.0, batch_size=64, lr_scaling="none", optimizer="adadelta", momentum=0.0, weight_decay=0.0,
                    scheduler="step", step_size=1, gamma=0.7, epochs=4)  # fmt: skip
    return SimpleNamespace(**{**defaults, **kw})


@pytest.mark.parametrize("rule, factor", [("none", 1), ("linear", 4), ("sqrt", 2)])
def test_learning_rate_follows_the_global_batch(rule, factor):
    assert flags.learning_rate(args(batch_size=256, lr_scaling=rule, lr=0.5)) == 0.5 * factor


@pytest.mark.parametrize("name, kind", [("adadelta", torch.optim.Adadelta), ("adam", torch.optim.Adam),
                                        ("rmsprop", torch.optim.RMSprop), ("sgd", torch.optim.SGD)])  # fmt: skip
def test_optimizers(name, kind):
    opt = recipes.optimizer(args(optimizer=name, momentum=0.9, weight_decay=1e-4), [torch.nn.Parameter(torch.ones(2))])
    assert isinstance(opt, kind) and opt.param_groups[0]["weight_decay"] == 1e-4


@pytest.mark.parametrize("name, lrs", [("step", [1.0, 1.0, 0.5, 0.5]), ("cosine", [1.0, 0.854, 0.5, 0.146])])  # fmt: skip
def test_schedules(name, lrs):
    opt = optim.optimizer(args(), [torch.nn.Parameter(torch.ones(2))])
    sched = recipes.scheduler(args(scheduler=name, gamma=0.5, step_size=2), opt)
    seen = []
    for _ in range(4):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs, abs=1e-3)


RECIPES = [  # flags -> what the stage trains with: the lesson's Adadelta and StepLR, or what a flag asks for
    ([], lambda o, s: type(o) is torch.optim.Adadelta and type(s) is torch.optim.lr_scheduler.StepLR),
    (["--optimizer", "sgd", "--momentum", "0.9"], lambda o, s: o.defaults["momentum"] == 0.9),
    (["--weight-decay", "0.1"], lambda o, s: o.defaults["weight_decay"] == 0.1),
    (["--scheduler", "cosine"], lambda o, s: type(s) is torch.optim.lr_scheduler.CosineAnnealingLR),
    (["--step-size", "2"], lambda o, s: s.step_size == 2),
    (["--lr-scaling", "linear", "--batch-size", "128"], lambda o, s: o.defaults["lr"] == 2.0),
    (["--clip-grad", "1"], lambda o, s: s.clip == 1.0),
    (["--optimizer", "adadelta", "--weight-decay", "0"], lambda o, s: type(o) is torch.optim.Adadelta),  # as none
]
# the same values set by the task, not by a flag: its parser default, an option of its own for the flag's dest, its
# check(args); a recipe value is trained wherever it came from
BY_THE_TASK = {
    "a default": "def add_arguments(group):\n    group.set_defaults(optimizer='sgd', momentum=0.9)\n",
    "an alias": "def add_arguments(group):\n    group.add_argument('--opt', dest='optimizer', default='sgd')\n",
    "check()": "def check(args):\n    args.optimizer = 'sgd'\n",
}


def trained_with(args, task):
    """The optimizer and scheduler a stage trains with, built as every train.py builds them."""
    model = torch.nn.Linear(2, 1)
    optimizer = optim.optimizer(args, model.parameters())
    scheduler = optim.scheduler(args, optimizer)
    states = dict(model=model, optimizer=optimizer, scheduler=scheduler)
    step = optim.Step(model, torch.device("cpu"), optimizer, None, None, None)
    if flags.LESSON.items() - vars(args).items() or hooks.RECIPE & vars(task).keys():  # as train.py
        step, scheduler = hooks.recipe(step, states, task, args)
    assert states["optimizer"] is step.optimizer
    return step.optimizer, scheduler


@pytest.mark.parametrize("argv, trains_with", RECIPES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_flag_of_the_recipe_is_what_the_stage_trains_with(argv, trains_with):
    """The lesson builds pytorch/examples' Adadelta and StepLR; a recipe value other than the lesson's (flags.LESSON)
    enters hooks.recipe(), which builds it in their place (common/options/recipes.py): never parsed and unread."""
    assert trains_with(*trained_with(*cli.parse_args(argv, [flags.add])))


@pytest.mark.parametrize("how", BY_THE_TASK)
def test_a_recipe_value_the_task_sets_is_what_the_stage_trains_with(how, tmp_path):
    """A recipe value set by the task, not given as a flag, was recorded in the run's manifest and not trained (the
    stage entered hooks.recipe() on a flag's argparse action alone): now the values decide."""
    task = tmp_path / "task.py"
    task.write_text(BY_THE_TASK[how])
    args, task = cli.parse_args(["--task", str(task)] + ["--opt", "sgd"] * (how == "an alias"), [flags.add])
    optimizer, _ = trained_with(args, task)
    assert args.optimizer == "sgd" and type(optimizer) is torch.optim.SGD


def test_every_value_the_recipe_reads_is_the_lessons_or_its_own():
    """What recipes.py and hooks.recipe() read of args is a flag of the lesson's (--lr, --gamma...) or a recipe value
    of flags.LARGE, which decides whether a stage enters them; the flags default to the lesson's recipe."""
    p = cli.parser(S03, [flags.add, flags.large])
    defaults = {a.dest: a.default for a in p._actions if a.dest in flags.LARGE}
    assert defaults == flags.LARGE and flags.LARGE == flags.LESSON | {"grad_accum": 1}
    source = (REPO / "common/options/recipes.py").read_text() + inspect.getsource(hooks.recipe)
    assert set(re.findall(r"args\.(\w+)", source)) - {"lr", "batch_size", "gamma", "epochs", "full_shard"} <= set(
        flags.LARGE
    )


@pytest.mark.parametrize("pair", [("net", "cifar10"), ("net", "synthetic"), ("wideresnet", "mnist")])
def test_parser_refuses_untested_pairs(pair, capsys):
    with pytest.raises(cli.UsageError, match=f"--model {pair[0]} is tested with"):
        cli.parse_args(["--model", pair[0], "--dataset", pair[1]], [flags.add])  # the built-in task's check()


@pytest.mark.slow
def test_validation_and_early_stop(tiny_data, tmp_path):
    """A validation split is reported each epoch; --target stops every rank at the same epoch,
    and the count survives a resume (the rows it is made of are in the checkpoint)."""
    flags = ("--epochs", 5, "--val-fraction", 0.25, "--target", 2, "--patience", 2)
    out = run([sys.executable, "01_single_gpu/train.py", *stage_args(tiny_data, tmp_path, *flags)])
    assert out.returncode == 0, out.stderr
    assert [line.split("|")[0].strip() for line in out.stdout.splitlines() if line.startswith("epoch ")] == [
        "epoch   1", "epoch   2"]  # fmt: skip
    rows = metrics(tmp_path)
    assert len(rows) == 2 and all(0 <= float(r["val_accuracy"]) <= 100 for r in rows)
    again = run([sys.executable, "01_single_gpu/train.py", *stage_args(tiny_data, tmp_path, *flags, "--resume")])
    assert again.returncode == 0 and "epoch   3" not in again.stdout and "done: 2 epochs" in again.stdout


@pytest.mark.slow
def test_stage03_wideresnet_on_cifar_with_two_ranks(tiny_sets, tmp_path):
    """WideResNet-16-4 on CIFAR-10's real file format, DDP over two gloo ranks, with a validation split."""
    flags = ("--dataset", "cifar10", "--model", "wideresnet", "--optimizer", "sgd", "--momentum", 0.9, "--lr", 0.05,
             "--scheduler", "cosine", "--val-fraction", 0.2, "--batch-size", 8, "--epochs", 2)  # fmt: skip
    out = launched(2, S03, *stage_args(tiny_sets, tmp_path, *flags))
    assert out.returncode == 0, out.stderr
    rows = metrics(tmp_path)
    assert [int(r["world_size"]) for r in rows] == [2, 2] and all(r["val_accuracy"] != "" for r in rows)
    assert float(rows[1]["lr"]) < float(rows[0]["lr"])  # cosine
