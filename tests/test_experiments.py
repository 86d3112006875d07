"""The workshop flags: optimizers, schedules, the learning-rate rule, early stopping, validation."""

import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import S03, launched, metrics, run, stage_args

from common import cli, optim
from common.options import flags


def args(**kw):
    defaults = dict(lr=1.0, batch_size=64, lr_scaling="none", optimizer="adadelta", momentum=0.0, weight_decay=0.0,
                    scheduler="step", step_size=1, gamma=0.7, epochs=4)  # fmt: skip
    return SimpleNamespace(**{**defaults, **kw})


@pytest.mark.parametrize("rule, factor", [("none", 1), ("linear", 4), ("sqrt", 2)])
def test_learning_rate_follows_the_global_batch(rule, factor):
    assert cli.learning_rate(args(batch_size=256, lr_scaling=rule, lr=0.5)) == 0.5 * factor


@pytest.mark.parametrize("name, kind", [("adadelta", torch.optim.Adadelta), ("adam", torch.optim.Adam),
                                        ("rmsprop", torch.optim.RMSprop), ("sgd", torch.optim.SGD)])  # fmt: skip
def test_optimizers(name, kind):
    opt = optim.optimizer(args(optimizer=name, momentum=0.9, weight_decay=1e-4), [torch.nn.Parameter(torch.ones(2))])
    assert isinstance(opt, kind) and opt.param_groups[0]["weight_decay"] == 1e-4


@pytest.mark.parametrize("name, lrs", [("step", [1.0, 1.0, 0.5, 0.5]), ("cosine", [1.0, 0.854, 0.5, 0.146])])  # fmt: skip
def test_schedules(name, lrs):
    opt = optim.optimizer(args(), [torch.nn.Parameter(torch.ones(2))])
    sched = optim.scheduler(args(scheduler=name, gamma=0.5, step_size=2), opt)
    seen = []
    for _ in range(4):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs, abs=1e-3)


@pytest.mark.parametrize("pair", [("net", "cifar10"), ("net", "synthetic"), ("wideresnet", "mnist")])
def test_parser_refuses_untested_pairs(pair, capsys):
    with pytest.raises(cli.UsageError, match=f"--model {pair[0]} is tested with"):
        cli.parse_args(["--model", pair[0], "--dataset", pair[1]], [flags.add])  # the built-in task's check()


@pytest.mark.slow
def test_validation_and_early_stop(tiny_data, tmp_path):
    """A validation split is reported each epoch; --target stops every rank at the same epoch,
    and the count survives a resume (the rows it is made of are in the checkpoint)."""
    flags = ("--epochs", 5, "--val-fraction", 0.25, "--target", 1, "--patience", 2)
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
