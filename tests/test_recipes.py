"""A task's own figures and recipe (common/options/hooks.py): a metric that is right or refused, its loss as the
figure when it has no metric, weights(args) in every stage with a new head left fresh or a misfit named in one
line, its optimizer() and scheduler() (stepped per optimizer step), --clip-grad, and a resume with another recipe
refused. The examples of common/tasks/examples/ through the stages are the slow tests at the end."""

import argparse
import collections
import contextlib
import io
import json
import re
import signal
import types

import pytest
import test_equivalence
import torch
from helpers import (
    REPO,
    S01,
    S03,
    S05,
    assert_same_state,
    checkpoint,
    clean_env,
    launched,
    metrics,
    one_error,
    python,
    stage_args,
    start,
    torchrun,
)
from test_preemption import SLOW, saved_mid_epoch, signal_mid_epoch_2
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from common import cli, data, optim
from common.guards import misfits, preflight, pretrained, samples
from common.metrics import Epoch, Log, Metric
from common.options import flags, hooks

EXAMPLES = REPO / "common" / "tasks" / "examples"


def task(**hooks_):
    return types.SimpleNamespace(**hooks_)


def metric_of(task_, **flags):
    return hooks.metric(task_, argparse.Namespace(**flags))


def test_a_score_summed_over_the_batch_is_refused_in_one_line():
    """score() returns one value per sample; a sum over every token printed "token_accuracy 1970.0000"."""
    output, target = torch.randn(4, 3, 5), torch.randint(0, 3, (4, 5))
    summed = metric_of(task(metric=("token_accuracy", "higher"), score=lambda o, t: (o.argmax(1) == t).sum()))
    with pytest.raises(ValueError, match=r"one value per sample, of shape \(4,\) for this batch, not \(\)"):
        summed.score(output, target)
    per_sample = metric_of(
        task(metric=("token_accuracy", "higher"), score=lambda o, t: (o.argmax(1) == t).float().mean(1))
    )
    assert per_sample.score(output, target) == (output.argmax(1) == target).float().mean(1).sum()


def test_per_pixel_labels_count_the_pixels_right_over_the_pixels():
    """(B, C, H, W) outputs, (B, H, W) labels: the default accuracy printed "accuracy 268138/300 (89379.33%)"."""
    output = torch.zeros(2, 3, 2, 2)
    output[:, 1] = 1  # every pixel class 1
    target = torch.tensor([[[1, 1], [1, 0]], [[1, 2], [0, 0]]])  # 3 of 4 right, then 1 of 4
    assert Metric().score(output, target) == pytest.approx(1.0)  # 0.75 + 0.25 samples right
    assert Metric().value([Metric().score(output, target)], 2) == pytest.approx(50.0)  # % of the pixels


def test_labels_of_minus_100_count_in_no_samples_accuracy():
    """(B, T) labels padded with -100, which cross-entropy ignores: the default accuracy counted the padding as wrong
    answers, 54.26 % at --test-batch-size 1000 and 100.00 % at 1 for the same weights (the padding's width)."""
    output = torch.zeros(2, 3, 4)
    output[:, 1] = 1  # every position class 1
    target = torch.tensor([[1, 1, -100, -100], [1, 0, 1, -100]])  # 2 of 2 labelled right, then 2 of 3
    assert Metric().score(output, target) == pytest.approx(1 + 2 / 3)
    wider, padded = torch.cat([output, torch.zeros(2, 3, 3)], 2), torch.cat([target, torch.full((2, 3), -100)], 1)
    assert Metric().score(wider, padded) == Metric().score(output, target)  # the padding's width: none of it
    assert Metric().score(output[:1], torch.full((1, 4), -100)).isnan()  # none labelled: no accuracy, not 0 or 1


def test_the_epoch_lines_count_of_per_pixel_accuracy_is_its_sum_of_shares(tmp_path):
    """Per-pixel labels through the default accuracy: each image scores its share of pixels right, and the line
    printed "accuracy 101/120 (84.96%)", the sum of shares cut to a whole number, which counts nothing (101/120 is
    84.17 %). It prints the sum as it is, whole where each sample is right or wrong (MNIST's 9840/10000)."""
    log = Log(tmp_path, 1, Metric())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the sums all-reduced, read as the stages read them
        for epoch, right in ((1, 101.957), (2, 98.0)):
            totals = torch.tensor([[12.0, 0.0, 120.0], [0.0, 0.0, 0.0], [6.0, right, 120.0]])
            log.epoch(epoch, 1.0, 2.0, Epoch.read(totals))
    first, second = printed.getvalue().splitlines()
    assert "| accuracy 101.957/120 (84.96%) |" in first and "| accuracy 98/120 (81.67%) |" in second, printed


def right_and_all(output, target):
    return torch.stack([(output.argmax(1) == target).sum().float(), torch.tensor(float(len(target)))])


def test_a_task_metric_named_accuracy_is_the_stages_kind_or_one_line():
    """A metric named accuracy is shown in %, counted right/all, and read so by --target and the tools: a
    figure of totals() (right/all: "accuracy 359/640 (0.56%)"), a lower-is-better one, or a score() in %
    ("5609.38%", a target of 99 reached at once) was a plausible wrong number; a score() of each sample's share
    right is the stages' own."""
    shares = task(metric=("accuracy", "higher"), score=lambda o, t: (o.argmax(1) == t).float())
    assert metric_of(shares).value([3.0], 4) == pytest.approx(75.0)  # in %, as the default accuracy
    for wrong in (
        task(metric=("accuracy", "higher"), totals=right_and_all, figure=lambda t: t[0] / t[1]),
        task(metric=("accuracy", "lower"), score=shares.score),
    ):
        with pytest.raises(ValueError, match=r'is not the stages\' accuracy, .*\("token_accuracy", "higher"\)'):
            metric_of(wrong)
    for percent in ([300.0], [-1.0]):  # score() gave 100 (or -1) a sample right: 7500 %, -25 %
        with pytest.raises(ValueError, match=r"the task's accuracy came to -?\d+%: its score\(\) must give each"):
            metric_of(shares).value(percent, 4)
    assert metric_of(shares).value([float("nan")], 4) != metric_of(shares).value([float("nan")], 4)  # nan: logged
    tokens = task(metric=("token_accuracy", "higher"), totals=right_and_all, figure=lambda t: t[0] / t[1])
    assert metric_of(tokens).value([359.0, 640.0], 640) == pytest.approx(359 / 640)  # its own name: as it is


def test_a_tasks_totals_are_summed_over_the_epoch_and_its_figure_taken_of_them():
    """Micro-F1, a data set's IoU, perplexity: a figure of the epoch's sums, which a mean of per-sample values
    is not; a row of another length, or not a float tensor, is one line."""
    totalled = metric_of(task(metric=("share", "higher"), totals=right_and_all, figure=lambda t: t[0] / t[1]))
    output, target = torch.eye(3), torch.tensor([0, 1, 0])
    assert totalled.score(output, target).tolist() == [2.0, 3.0] and totalled.better == "higher"
    read = Epoch.read(torch.tensor([[1.0, 0, 0, 8], [0, 0, 0, 0], [0.5, 2, 3, 3]]))  # loss, totals..., samples
    assert read.test.score == [2.0, 3.0] and totalled.value(read.test.score, 3) == pytest.approx(2 / 3)
    for wrong, said in ((torch.ones(3), r"float32 of shape \(3,\)"), (torch.ones(2, 1), r"shape \(2, 1\)")):
        with pytest.raises(ValueError, match=r"a 1-D float tensor of one length every batch \(the first's: 2\)"):
            task_ = task(metric=("share", "higher"), totals=lambda o, t, w=wrong: w, figure=None)
            broken = metric_of(task_)
            broken.width = 2  # as after a first batch of two sums
            broken.score(output, target)
        with pytest.raises(ValueError, match=said):
            broken.score(output, target)
    with pytest.raises(ValueError, match="not a int"):
        metric_of(task(metric=("share", "higher"), totals=lambda o, t: 3, figure=None)).score(output, target)
    with pytest.raises(SystemExit, match="either a function score"):  # both ways at once: neither is right
        both = task(metric=("share", "higher"), score=lambda o, t: o, totals=right_and_all, figure=lambda t: t)
        samples.check_metric(argparse.Namespace(task="task.py"), both)


FIGURE = """from common.tasks.images import add_arguments, check, datasets, model
import torch

metric = ("balanced_recall", "higher")

def totals(output, target):  # each class's right answers, then its samples: a class of none is 0/0
    right = torch.zeros(12).index_add_(0, target, (output.argmax(1) == target).float())
    return torch.cat([right, torch.zeros(12).index_add_(0, target, torch.ones(len(target)))])

def figure(totals):
    return (totals[:12] / totals[12:]).mean()
"""


def test_a_figure_that_is_no_finite_number_is_refused_before_its_row(tmp_path):
    """A figure() of a class with no sample (0/0: a recall, an IoU) was logged as nan, saved, and the tools then
    called metrics.csv damaged; a figure of several numbers failed naming the lesson's line. One line naming
    figure(), before the epoch's row and checkpoint."""
    for wrong, said in (
        (lambda t: t[0] / t[1], r"not nan \(of the epoch's totals \[0.0, 0.0\]\)"),
        (lambda t: t, r"not \[0.0, 0.0\]"),
    ):
        with pytest.raises(ValueError, match=r"the task's figure\(totals\) must be one finite number, " + said):
            metric_of(task(metric=("share", "higher"), totals=right_and_all, figure=wrong)).value([0.0, 0.0], 3)
    (tmp_path / "recall.py").write_text(FIGURE)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", tmp_path / "recall.py", "--limit", 256))
    one_error(out, "the task's figure(totals) must be one finite number, not nan", "torch.nanmean")
    assert not (tmp_path / "out" / "metrics.csv").exists() and not (tmp_path / "out" / "checkpoint.pt").exists()


def test_totals_at_more_ranks_than_a_split_has_samples_are_refused_in_one_line(monkeypatch):
    """A rank without a sample of a split makes no row of totals: the ranks' rows differ in length, and gloo
    aborted the run ("Received data size doesn't match expected size") with rank 0 blaming rank 1."""
    monkeypatch.setattr(samples.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(samples.dist, "get_world_size", lambda: 2)
    args, totalled = argparse.Namespace(task="t.py"), task(totals=right_and_all, figure=lambda t: t[0] / t[1])
    with pytest.raises(SystemExit, match=r"totals\(\) need a sample on every rank: a split of 1 samples at 2 ranks"):
        samples.check_totals(args, totalled, (0, 1))
    samples.check_totals(args, totalled, (0, 2))  # no validation split; a test sample on each rank
    samples.check_totals(args, task(score=lambda o, t: o), (0, 1))  # scores per sample: a rank without adds 0


def test_an_evaluation_calls_loss_on_every_rank_and_batch_and_counts_each_sample_once():
    """Nine samples at two ranks in batches of 2 and 3: rank 1's last batch is its padding alone, or shares it
    with a sample. loss() was called only where a rank held samples, so a collective in it (a loss over the
    global batch) waited at the others for ever; the padding, a copy of sample 0, must count nowhere."""
    stage01 = test_equivalence.stage("01_single_gpu")
    x, y = torch.randn(9, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2] * 3)
    x[0] = torch.tensor([0.0, 0.0, 9.0])  # sample 0, the padding, wrong: counted twice it would show
    shares = task(metric=("share", "higher"), totals=right_and_all, figure=lambda t: t[0] / t[1])
    for batch, made in ((2, Metric), (3, Metric), (2, lambda: metric_of(shares)), (3, lambda: metric_of(shares))):
        metric = made()
        calls, sums = [], []
        for rank in range(2):
            shard = data.shard(9, rank, 2)
            loader = data.loader(TensorDataset(x, y), shard.indices, batch, torch.device("cpu"))

            def loss(output, target, rank=rank, calls=calls):
                calls.append((rank, len(target)))
                return F.cross_entropy(output, target)

            step = optim.Step(nn.Identity(), torch.device("cpu"), None, loss, metric.score, None)
            sums.append(stage01.evaluate(step, loader, shard.samples, test_equivalence.RUN))
        assert [r for r, _ in calls].count(0) == [r for r, _ in calls].count(1) == len(loader), calls
        assert sum(s.samples for s in sums) == 9 and ((1, 0) in calls) == (batch == 2)  # the padding cut
        right = torch.stack([s.score for s in sums]).sum(0)
        assert right.tolist() == (right_and_all(x, y) if made is not Metric else right_and_all(x, y)[0]).tolist()
        whole = F.cross_entropy(x, y, reduction="sum")
        assert float(sum(s.loss for s in sums)) == pytest.approx(float(whole), rel=1e-6)


def test_a_task_with_a_loss_and_no_metric_reports_its_loss_never_an_accuracy():
    """A float-target MSE task without a metric printed "accuracy 263/1001 (26.27%)"."""
    mse = metric_of(task(loss=lambda o, t: F.mse_loss(o.squeeze(1), t)))
    output, target = torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 0.0])
    assert (mse.name, mse.better) == ("mean_loss", "lower") and mse.score(output, target) == pytest.approx(5.0)
    assert hooks.OWN & {"loss"}  # the stages enter hooks.metric() for a task with a loss() alone


def test_a_tasks_throughput_names_the_speeds_unit_or_is_one_line(tmp_path):
    """A language model's epoch line said samples/s: its throughput(args) makes it tokens/s, --seq-len to a
    sample; anything but (a name, a whole count above 0) is refused before the first step."""
    lm = task(loss=F.cross_entropy, throughput=lambda args: ("tokens", args.seq_len))
    assert metric_of(lm, seq_len=16).unit == ("tokens", 16) and metric_of(task(loss=F.cross_entropy)).unit[1] == 1
    for wrong in (("tokens", 0), ("tokens", 2.5), ("tokens", True), "tokens", ("tokens", 16, "x")):
        with pytest.raises(ValueError, match=r"must return \(unit, count per sample\), e.g."):
            metric_of(task(throughput=lambda args, w=wrong: w))
    for hooked in (task(throughput=lambda args: ("pixels", 4)), lm):  # the default metric too, and a task's
        log = Log(tmp_path, 2, metric_of(hooked, seq_len=16))
        row = {"epoch": 1, "lr": 1.0, "train_loss": 1.0, "val_loss": "", "test_loss": 1.0, "epoch_seconds": 2.0}
        row |= {"images_per_s": 100.0, "peak_memory_mib": "", "compile_seconds": 0, f"test_{log.metric.name}": 1.0}
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            log.say(row, "1/2")
        unit, per_sample = log.metric.unit
        assert f"| {100 * per_sample} {unit}/s ({50 * per_sample} per process)\n" in printed.getvalue()


def test_token_labels_without_a_loss_are_one_line_naming_loss():
    """(B, T) labels and (B, T, C) outputs through the default cross-entropy: torch's shape message, alone."""
    try:
        F.cross_entropy(torch.randn(4, 16, 256), torch.randint(0, 256, (4, 16)))
    except RuntimeError as err:
        said = misfits.explain(err, "task.py")
    assert said.startswith("error: --task task.py: the default loss, cross-entropy, takes outputs (B, C, ...)"), said
    assert "outputs of shape [4, 16, 256]" in said and "define loss(output, target)" in said


def test_labels_and_outputs_the_default_loss_cannot_take_and_a_full_dev_shm_are_named_as_such():
    """int32 or bool labels, a model returning a dict (a Hugging Face output) under the default loss, and a /dev/shm
    too small for the workers' batches (a container's 64 MB): each was a line naming the stage's train_step(), or the
    task's collate() for the shared memory, with "fix it"."""

    def said(call):
        try:
            call()
        except (RuntimeError, TypeError) as err:
            return misfits.explain(err, "task.py")
        raise AssertionError("no error")

    for dtype in (torch.int32, torch.bool):
        line = said(lambda d=dtype: F.cross_entropy(torch.randn(4, 3), torch.zeros(4, dtype=d)))
        assert line.startswith(f"error: --task task.py: labels of dtype {torch.zeros(1, dtype=dtype).dtype}, but"), line
        assert ".long()" in line
    line = said(lambda: F.cross_entropy({"logits": torch.randn(4, 3)}, torch.zeros(4, dtype=torch.long)))
    assert line.startswith("error: --task task.py: model(args) returns a dict, but the default loss"), line
    full = RuntimeError(
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n  File "
        '"collate.py", line 1, in default_collate\nRuntimeError: unable to allocate shared memory(shm) for file '
        "</torch_1_2_3>: No space left on device (28)"
    )
    line = misfits.explain(full, "task.py")
    assert line.startswith("error: /dev/shm is full (RuntimeError: unable to allocate shared memory(shm)"), line
    assert "collate" not in line and "--num-workers 0" in line


def test_the_contrastive_example_refuses_micro_batches_which_would_change_its_loss():
    """--grad-accum 2 gave its loss() each half batch alone: half the negatives, another loss (train loss 2.33, not
    2.99), said nowhere."""
    from common.tasks.examples import contrastive

    assert "--grad-accum: this loss compares each view with the batch's" in contrastive.check(
        argparse.Namespace(grad_accum=2)
    )
    assert (
        contrastive.check(argparse.Namespace(grad_accum=1)) is None and contrastive.check(argparse.Namespace()) is None
    )


def test_a_0_dim_tensor_in_the_labels_is_one_line():
    """A collate() adding the batch's token count to its labels: first among them, the stages' count() failed and
    the line blamed collate(), printing the options as shapes; after the ids, a rank's padded last evaluation batch
    was cut and its loss divided by the uncut count (test loss 2.09, not 2.50, at 2 ranks)."""
    pairs = [(torch.arange(4), torch.arange(4)), (torch.arange(4), torch.arange(4))]
    for labels in (lambda y: {"ntokens": torch.tensor(y.numel()), "ids": y}, lambda y: [y, torch.tensor(8)]):
        own = task(
            collate=lambda s, labels=labels: (torch.stack([x for x, _ in s]), labels(torch.stack([y for _, y in s])))
        )
        with pytest.raises(
            SystemExit, match=r"its collate\(\) returns labels holding a 0-dim tensor \(8\): the stages cut"
        ):
            samples.check_collate(argparse.Namespace(task="task.py"), own, "training", pairs)


def test_a_task_that_leaves_limit_unread_is_one_line():
    """--limit 640 with a task whose datasets() keep every sample: the run trained on 4,000 and tested on 800, a
    quick run that was not, with --limit recorded as what defined it."""
    pairs = TensorDataset(torch.randn(10, 3), torch.arange(10) % 2)
    args = argparse.Namespace(task="task.py", limit=4, loader="batched")
    with pytest.raises(
        SystemExit, match=r"^error: --task task.py: --limit 4, but its datasets\(\) returned a set of 10 "
    ):
        preflight.check_datasets(args, task(), pairs, pairs)
    cut = torch.utils.data.Subset(pairs, range(4))
    preflight.check_datasets(args, task(), cut, cut)
    preflight.check_datasets(argparse.Namespace(task="task.py", limit=None, loader="batched"), task(), pairs, pairs)


def test_a_tasks_own_loss_that_misshapes_cross_entropy_is_named_as_the_tasks():
    """The task's loss() calling F.cross_entropy on (B, T, C) outputs was told "the default loss ... define
    loss(output, target)": a cause it did not have, and advice it had followed."""
    code = "import torch.nn.functional as F\ndef loss(output, target):\n    return F.cross_entropy(output, target)\n"
    own = {}
    exec(compile(code, "/tmp/task.py", "exec"), own)  # as cli.load_task() runs a task: its file's name
    try:
        own["loss"](torch.randn(4, 16, 256), torch.randint(0, 256, (4, 16)))
    except RuntimeError as err:
        said = misfits.explain(err, "/tmp/task.py")
    named = "error: --task /tmp/task.py: its loss(output, target) gives cross-entropy outputs of shape [4, 16, 256]"
    assert said.startswith(named + " that do not fit"), said
    assert "default" not in said and "the model's outputs start with it" in said and "\n" not in said


def test_float_labels_without_a_loss_are_refused_naming_loss(tmp_path):
    """Multi-hot float labels with a metric of its own but the default cross-entropy trained as soft labels."""
    multi_hot = TensorDataset(torch.randn(4, 3), torch.tensor([[1.0, 0.0, 1.0]] * 4))
    own = task(metric=("f1", "higher"), score=lambda o, t: o.sum(1))
    args = argparse.Namespace(task=tmp_path / "task.py")
    with pytest.raises(SystemExit) as stop:
        preflight.check_datasets(args, own, multi_hot, multi_hot)
    assert "a label of torch.float32" in stop.value.code and "define loss(output, target)" in stop.value.code


def test_a_weights_file_that_does_not_fit_is_one_line_naming_the_keys(tmp_path):
    """A 1000-class file for a 3-class head failed in stage 05 with "The size of tensor a (2) must match the size
    of tensor b (500)"; a file without fc.* with torch's list, the keys elided; stages 01-04 ignored the file."""
    path = tmp_path / "whole.pt"
    big = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    torch.save(big.state_dict(), path)
    small = task(model=lambda args: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), weights=lambda a: path)
    args = argparse.Namespace(task=tmp_path / "task.py")
    with pytest.raises(SystemExit) as stop:
        pretrained.check_weights(args, small)
    said = stop.value.code
    assert "does not fit model(args): 2 mis-shaped (2.weight [10, 8] in the file, [3, 8] in the model" in said, said
    assert said.endswith('FRESH = ("fc.",)') and "\n" not in said
    pretrained.check_weights(args, task(FRESH=("2.",), **vars(small)))  # the new head left fresh: it fits


def test_a_weights_file_of_a_wrapped_model_is_one_line_naming_its_prefix(tmp_path):
    """A DDP model's state dict ("module.conv1.weight"), or a compiled one's ("_orig_mod."), was told to name a new
    head in FRESH, of every key, missing and unexpected alike."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    args = argparse.Namespace(task=tmp_path / "task.py")
    for wrapper in ("module.", "_orig_mod."):
        path = tmp_path / f"{wrapper}pt"
        torch.save({wrapper + k: v for k, v in model.state_dict().items()}, path)
        with pytest.raises(SystemExit) as stop:
            pretrained.check_weights(args, task(model=lambda args: model, weights=lambda a, p=path: p))
        said = stop.value.code
        assert f"its keys are the model's behind '{wrapper}' ({wrapper}0.weight for 0.weight): save the model" in said
        assert "FRESH" not in said and "\n" not in said, said


def test_fresh_leaves_the_keys_it_names_and_a_prefix_naming_none_is_one_line(tmp_path):
    """FRESH = "fc." (a string, not a tuple) was read as its letters: "c" left conv.* at its initialisation too,
    untold; FRESH = ("head.",), naming no key, loaded the old head over the new one of the same shape, untold."""
    path, layers = tmp_path / "whole.pt", {"conv": nn.Linear(4, 8), "relu": nn.ReLU(), "fc": nn.Linear(8, 3)}
    torch.save(nn.Sequential(collections.OrderedDict(layers)).state_dict(), path)
    fresh = nn.Sequential(collections.OrderedDict(layers | {"conv": nn.Linear(4, 8), "fc": nn.Linear(8, 3)}))
    started = {k: v.clone() for k, v in fresh.state_dict().items()}
    hooks.load_weights(fresh, path, hooks.kept_fresh(task(FRESH="fc.")))
    assert torch.equal(fresh.conv.weight, layers["conv"].weight) and torch.equal(fresh.fc.weight, started["fc.weight"])
    args, model = argparse.Namespace(task=tmp_path / "task.py"), lambda args: fresh
    pretrained.check_weights(args, task(model=model, weights=lambda a: path, FRESH="fc."))  # it fits
    for named, said in (
        (("head.",), "has no key starting with FRESH's 'head.'"),
        (("fc.", ""), "has every key starting with FRESH's ''"),
    ):
        with pytest.raises(SystemExit) as stop:
            pretrained.check_weights(args, task(model=model, weights=lambda a: path, FRESH=named))
        assert f"file {path} {said} (conv.weight, conv.bias, fc.weight, ...): name the keys" in stop.value.code
        assert "\n" not in stop.value.code


def test_a_weights_file_with_an_integer_or_a_nan_tensor_is_one_line_naming_it(tmp_path):
    """Loaded as they were, an int64 bias was rounded into the weights without a word, and a NaN trained as a run
    that diverged: "try a lower --lr", naming neither the file nor the key."""
    path, model = tmp_path / "whole.pt", nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    weights = model.state_dict() | {"0.bias": torch.arange(8), "2.weight": torch.full((3, 8), float("nan"))}
    torch.save(weights, path)
    args = argparse.Namespace(task=tmp_path / "task.py")
    with pytest.raises(SystemExit) as stop:
        pretrained.check_weights(args, task(model=lambda args: model, weights=lambda a: path))
    said = stop.value.code
    assert f"weights(args) file {path} does not fit model(args): 1 not floating-point (0.bias torch.int64)" in said
    assert "1 not finite (2.weight)" in said and "FRESH" not in said and "\n" not in said, said


def test_a_model_that_loads_its_own_weights_is_refused_in_stage_05_pointing_to_weights(tmp_path):
    """The torchvision idiom, resnet18(weights=...): stage 05 built it on the meta device and trained from a
    random start."""
    saved = nn.Linear(4, 2).state_dict()

    def loads_itself(args):
        made = nn.Linear(4, 2)
        made.load_state_dict(saved)
        return made

    stage05 = argparse.Namespace(task=tmp_path / "task.py", full_shard=False, amp=False)
    with pytest.raises(SystemExit) as stop:
        pretrained.check_meta_load(stage05, task(model=loads_itself))
    assert "model(args) loads weights itself" in stop.value.code and "weights(args)" in stop.value.code
    pretrained.check_meta_load(stage05, task(model=lambda args: nn.Linear(4, 2)))  # built alone: no word
    pretrained.check_meta_load(stage05, task(model=loads_itself, META=False))  # built whole: its weights kept


def test_a_weight_tied_across_stage_05s_units_is_named_before_it_is_sharded(tmp_path):
    """An embedding in a block whose weight the head at the root shares, built whole (META = False, as the tie
    asks): fully_shard() failed with torch's advice to shard both modules together, which no task can. One line
    naming both and blocks(); a blocks() that leaves the embedding to the root passes, and so does --amp's norm."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.BatchNorm1d(8))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.layers[0].weight

    stage05 = argparse.Namespace(task=tmp_path / "task.py", full_shard=False, amp=True)
    with pytest.raises(SystemExit) as stop:
        pretrained.check_meta_load(stage05, task(model=lambda args: Tied(), META=False))
    assert "layers.0 and head share a weight, and stage 05 shards them in two units" in stop.value.code
    assert "blocks(model)" in stop.value.code and "\n" not in stop.value.code
    pretrained.check_meta_load(stage05, task(model=lambda args: Tied(), META=False, blocks=lambda m: [m.layers[1]]))


def test_a_model_stage_05_would_start_otherwise_than_stage_01_is_refused(tmp_path):
    """Stage 05 fills each layer from its own reset_parameters() on the meta device. nn.TransformerEncoder deep-copies
    its first layer, whose copies start equal on the CPU: stage 05 drew each anew, another start (0.61 apart), unsaid.
    An init_weights() of no layer (pytorch/examples' word_language_model) failed in a TypeError naming no way out.
    Each is one line; layers built anew, an init_weights(layer) or META = False pass."""
    stage05 = argparse.Namespace(task=tmp_path / "task.py", full_shard=False, amp=False)

    def layer():
        return nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)

    def encoder(args):
        return nn.TransformerEncoder(layer(), 2, enable_nested_tensor=False)

    class Whole(nn.Linear):
        def init_weights(self):  # the whole model's, as the word language model's
            nn.init.zeros_(self.bias)

    with pytest.raises(SystemExit) as stop:
        pretrained.check_meta_load(stage05, task(model=encoder))
    assert "model(args) deep-copies a layer (a parameter of shape [" in stop.value.code, stop.value.code
    assert "META = False" in stop.value.code and "\n" not in stop.value.code
    with pytest.raises(SystemExit, match=r"the model's init_weights\(\) takes no layer: .* META = False in the task"):
        pretrained.check_meta_load(stage05, task(model=lambda args: Whole(4, 2)))
    pretrained.check_meta_load(stage05, task(model=lambda args: nn.Sequential(layer(), layer())))  # each drawn
    pretrained.check_meta_load(stage05, task(model=encoder, META=False))
    pretrained.check_meta_load(stage05, task(model=lambda args: Whole(4, 2), init_weights=lambda layer: None))
    assert nn.Parameter.__deepcopy__.__name__ == "__deepcopy__"  # torch's, put back


def test_every_stage_starts_from_weights_and_a_fresh_head_keeps_its_initialisation(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10)).state_dict(), path)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    head = model[2].weight.detach().clone()
    step, states, args = recipe_step(model)
    hooks.recipe(step, states, task(weights=lambda a: path, FRESH=("2.",)), args)
    assert torch.equal(model[0].weight, torch.load(path)["0.weight"]) and torch.equal(model[2].weight, head)


def test_a_tasks_optimizer_over_tensors_outside_its_model_is_one_line():
    """optimizer(args, model) over a new model(args)'s parameters, a slip of names: the run stepped those, trained
    nothing (loss 2.31, 9.84 % after two epochs) and said nothing."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    other = nn.Linear(4, 3)
    for own, said in (
        (lambda args, m: torch.optim.AdamW(other.parameters()), "holds 2 of its 2 tensors outside the model"),
        (
            lambda args, m: torch.optim.AdamW([*m.parameters(), other.bias]),
            "holds 1 of its 5 tensors outside the model",
        ),
    ):
        step, states, args = recipe_step(model)
        with pytest.raises(ValueError, match=said + r" it is given: build it over that model's parameters"):
            hooks.recipe(step, states, task(optimizer=own), args)
    step, states, args = recipe_step(model)  # a part of the model's (a linear probe) is its own choice
    step, _ = hooks.recipe(step, states, task(optimizer=lambda args, m: torch.optim.SGD(m[2].parameters())), args)
    assert [len(g["params"]) for g in step.optimizer.param_groups] == [2]


def test_stage_05_starts_from_weights_with_a_model_built_whole_too(tmp_path):
    """Stage 05 loads weights(args) into its model as every stage does, built on the meta device (and initialised)
    or whole on the CPU (META = False): one built whole was filled by nothing, and trained from its random start,
    without a word."""
    path = tmp_path / "whole.pt"
    torch.save(nn.Linear(4, 3).state_dict(), path)
    for meta in (False, True):  # loaded over the model materialise() initialised, or over one built whole
        model = nn.Linear(4, 3)
        start = model.weight.detach().clone()
        step, states, args = recipe_step(model)
        args.full_shard = True  # stage 05's
        hooks.recipe(step, states, task(weights=lambda a: path, META=meta), args)
        assert torch.equal(model.weight, torch.load(path)["weight"]) and not torch.equal(model.weight, start), meta


def recipe_step(model, clip=None):
    args = argparse.Namespace(
        optimizer="sgd",
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        scheduler="step",
        step_size=1,
        gamma=0.7,
        epochs=2,
        clip_grad=clip,
        batch_size=64,
        lr_scaling="none",
    )
    optimizer = optim.optimizer(args, model.parameters())
    states = dict(model=model, optimizer=optimizer, scheduler=optim.scheduler(args, optimizer))
    return optim.Step(model, torch.device("cpu"), optimizer, F.mse_loss, None, None), states, args


def warm_up(args, optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def adamw(args, model):
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr)


def test_a_tasks_optimizer_and_scheduler_step_per_optimizer_step_and_clip():
    """AdamW with parameter groups, a per-step warm-up and clipping were impossible: four --optimizer choices, a
    scheduler stepped per epoch, no clipping."""
    model = nn.Linear(3, 1)
    step, states, args = recipe_step(model, clip=0.5)
    step, scheduler = hooks.recipe(step, states, task(optimizer=adamw, scheduler=warm_up), args)
    assert isinstance(step.optimizer, torch.optim.AdamW) and states["optimizer"] is step.optimizer
    norms = []  # of the gradients the optimizer stepped with
    step.optimizer.register_step_post_hook(
        lambda *_: norms.append(float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()))
    )
    for _ in range(3):
        step.optimizer.zero_grad()
        (model(torch.full((2, 3), 100.0)).sum() * 100).backward()
        step.optimizer.step()
    assert max(norms) == pytest.approx(0.5, rel=1e-4)  # clipped before each step
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 3 / 4)] * 2  # the rate of the last step
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # stepped after each step
    scheduler.step()  # the stage's call at the epoch's end: the task's schedule is per step
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    saved = scheduler.state_dict()
    again, other = recipe_step(nn.Linear(3, 1)), recipe_step(nn.Linear(3, 1))
    _, same = hooks.recipe(*again[:2], task(optimizer=adamw, scheduler=warm_up), again[2])
    same.load_state_dict(saved)
    assert same.get_last_lr() == scheduler.get_last_lr() and same.inner.last_epoch == 3
    _, elsewise = hooks.recipe(*other[:2], task(scheduler=warm_up), other[2])  # SGD, not AdamW
    # the flags each recipe replaces and never reads, which the run's manifest records not (--optimizer's value was
    # there, and --lr-scaling's, as if applied): adamw reads --lr alone, warm_up nothing
    assert scheduler.unused == [
        "optimizer",
        "lr_scaling",
        "momentum",
        "weight_decay",
        "scheduler",
        "gamma",
        "step_size",
    ]
    assert elsewise.unused == ["scheduler", "gamma", "step_size"]
    with pytest.raises(ValueError, match="the checkpoint was trained with AdamW .* this run defines SGD"):
        elsewise.load_state_dict(saved)


def test_a_flag_a_tasks_optimizer_replaces_and_never_reads_is_one_line(tmp_path):
    """--lr-scaling linear with the recipe example's AdamW (at --lr, unscaled): the run trained as without it, and
    its manifest recorded it as applied. What the task's optimizer() reads (flags.learning_rate(): --lr and
    --lr-scaling) is the run's; a flag it replaces and never reads, typed, is one line before the first step."""
    scaled = "def optimizer(args, model):\n    return torch.optim.AdamW(model.parameters(), lr=learning_rate(args))\n"
    step, states, args = recipe_step(nn.Linear(3, 1))
    own = types.SimpleNamespace(optimizer=lambda args, model: torch.optim.AdamW(model.parameters(), lr=args.lr))
    assert "lr_scaling" in hooks.recipe(step, states, own, args)[1].unused
    step, states, args = recipe_step(nn.Linear(3, 1))
    reading = types.SimpleNamespace(
        optimizer=lambda args, model: torch.optim.AdamW(model.parameters(), lr=flags.learning_rate(args))
    )
    assert hooks.recipe(step, states, reading, args)[1].unused == ["optimizer", "momentum", "weight_decay"]
    recipe = ("--task", EXAMPLES / "recipe.py", "--samples", 64, "--epochs", 1, "--output-dir", tmp_path / "out")
    out = python(S01, *recipe, "--lr-scaling", "linear")
    said = "error: argument --lr-scaling: the task's optimizer() and scheduler() never read it: drop it (see --help)"
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == said, out.stderr[-2000:]
    task = tmp_path / "scaled.py"
    task.write_text(
        f"import torch\nfrom common.options.flags import learning_rate\nfrom common.tasks.examples.recipe import *\n\n\n{scaled}"
    )
    out = python(
        S01, *recipe[2:], "--task", task, "--lr-scaling", "linear", "--batch-size", 128, "--lr", 0.01, "--warmup", 1
    )
    assert out.returncode == 0 and "lr 0.0200" in out.stdout, out.stderr[-2000:]


# The examples, as a user brings them: each through stage 01, 03 and 05 at two ranks (make test-all)
EXAMPLE = {
    # odd test sets (11, 51, 13): at two ranks one rank's last batch holds a padding, cut from the totals
    "segmentation": ("segmentation.py", "iou", "--samples", 55, "--batch-size", 20, "--test-batch-size", 20),
    "recipe": (
        "recipe.py",
        "accuracy",
        "--samples",
        256,
        "--batch-size",
        32,
        "--clip-grad",
        1,
        "--lr",
        0.003,
        "--warmup",
        4,
    ),
    "multilabel": (
        "multilabel.py",
        "micro_f1",
        "--samples",
        256,
        "--batch-size",
        32,
        "--optimizer",
        "adam",
        "--lr",
        0.01,
    ),
    "bytes": (
        "bytes.py",
        "perplexity",
        "--samples",
        66,
        "--seq-len",
        16,
        "--dim",
        32,
        "--batch-size",
        16,
        "--optimizer",
        "adam",
        "--lr",
        0.003,
    ),
    "contrastive": ("contrastive.py", "alignment", "--samples", 64, "--batch-size", 16),
    "finetune": (
        "finetune.py",
        "accuracy",
        "--batch-size",
        8,
        "--test-batch-size",
        9,
        "--optimizer",
        "sgd",
        "--lr",
        0.01,
    ),
}


def folder_of_photos(root):
    """train/ and test/ ImageFolders of three colours, 24 and 9 images, and a 10-class resnet18's weights."""
    from PIL import Image
    from torchvision.models import resnet18

    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 24), ("test", 9)):
        for c, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(n // 3):
                noise = torch.randint(0, 60, (20, 20, 3), generator=g)
                pixels = (torch.tensor(colour) + noise).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / f"c{c}" / f"{i}.png")
    torch.save(resnet18(num_classes=10).state_dict(), root / "pretrained.pt")
    return ["--folder", root, "--weights-file", root / "pretrained.pt"]


def test_the_examples_limit_spans_every_class_and_their_schedule_the_steps_that_run(tmp_path):
    """finetune.py: an ImageFolder lists its samples class by class, and --limit 20 kept the first class alone (the
    run scored 100 %). recipe.py: its cosine counted the steps of the whole training set, --val-fraction's held-out
    part too, and ended at 81 % of its peak rate, not 0."""
    folder_of_photos(tmp_path)
    finetune = cli.load_task(EXAMPLES / "finetune.py")
    train, test = finetune.datasets(argparse.Namespace(folder=tmp_path, limit=6))
    assert len(train) == len(test) == 6 and {y for _, y in train} == {y for _, y in test} == {0, 1, 2}
    recipe = cli.load_task(EXAMPLES / "recipe.py")
    args = argparse.Namespace(samples=256, limit=None, val_fraction=0.5, batch_size=32, epochs=1, warmup=1)
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    schedule = recipe.scheduler(args, optimizer)
    for _ in range(4):  # the 4 steps of 128 samples left
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLE)
def test_an_example_trains_alike_in_stages_01_03_and_05(example, tmp_path):
    name, figure, *extra = EXAMPLE[example]
    if example == "finetune":
        extra += folder_of_photos(tmp_path / "photos")
    common = ["--task", EXAMPLES / name, "--epochs", 1, *extra]

    runs = {
        "01": python(S01, *common, "--output-dir", tmp_path / "01", timeout=600),
        "03": launched(2, S03, *common, "--output-dir", tmp_path / "03", timeout=600),
        "05": launched(2, S05, *common, "--output-dir", tmp_path / "05", timeout=600),
    }
    for stage, out in runs.items():
        assert out.returncode == 0, (stage, out.stderr[-2000:])
        row = metrics(tmp_path / stage)[0]
        low, high = {"accuracy": (0, 100), "perplexity": (1, 256), "alignment": (-1, 1)}.get(figure, (0, 1))
        assert low <= float(row[f"test_{figure}"]) <= high, row
        unit, per_sample = ("tokens", 16) if example == "bytes" else ("samples", 1)  # bytes: its --seq-len
        speed = re.search(rf"\| ([\d.]+) {unit}/s \(", out.stdout)
        assert speed and "img/s" not in out.stdout, out.stdout[-2000:]
        rate = float(row["images_per_s"]) * per_sample  # metrics.csv: samples/s
        assert float(speed[1]) == pytest.approx(rate, abs=0.5), (speed[0], row)  # printed to the unit
    one, ddp, fsdp = (float(metrics(tmp_path / stage)[0]["train_loss"]) for stage in runs)
    assert ddp == pytest.approx(fsdp, abs=1e-3), (ddp, fsdp)  # two ranks: the same global batch, the same start
    if example != "finetune":  # resnet18's BatchNorm normalises each rank's half batch: not one rank's numbers
        assert one == pytest.approx(ddp, abs=1e-3), (one, ddp)
    if example == "contrastive":  # a loss over the global batch, gathered with its gradient: float32's rounding
        assert one == pytest.approx(ddp, rel=1e-5), (one, ddp)  # apart (1e-7 measured)


SLOWED = """
import os, time
from common.tasks.examples import recipe
from common.tasks.examples.recipe import *


def optimizer(args, net):  # each step first sleeps STEP_SLEEP seconds: time to signal mid-epoch
    made = recipe.optimizer(args, net)
    made.register_step_pre_hook(lambda *_: time.sleep(float(os.environ.get("STEP_SLEEP", 0))))
    return made
"""


@pytest.mark.slow
@pytest.mark.parametrize("example, ranks", [("recipe", 2), ("segmentation", 1), ("multilabel", 1)])
def test_an_example_stopped_mid_epoch_resumes_bit_identical(example, ranks, tmp_path):
    """A per-step warm-up and clipping (recipe, two ranks), per-pixel labels, multi-hot labels and their F1."""
    name, _, *extra = EXAMPLE[example]
    task, slow = EXAMPLES / name, SLOW  # SLOW: Adadelta's steps sleep
    extra = [*extra, "--samples", 256, "--batch-size", 32]  # 8 steps an epoch, as test_preemption's
    if example == "recipe":  # AdamW, the task's own: its steps sleep
        task, slow = tmp_path / name, {"STEP_SLEEP": 0.3}
        task.write_text(SLOWED)
    else:
        extra += ["--optimizer", "adadelta", "--lr", 1.0]

    def options(out, *more):
        return ["--task", task, "--epochs", 2, *extra, "--output-dir", out, *more]

    def run(out, *more):
        ran = torchrun(2, S03, *options(out, *more), timeout=600) if ranks == 2 else python(S01, *options(out, *more))
        assert ran.returncode == 0, ran.stderr[-2000:]
        return ran

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole)
    proc = start(S03 if ranks == 2 else S01, *options(cut), nproc=ranks if ranks > 1 else None, env=clean_env(**slow))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    resumed = run(cut, "--resume")
    assert f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stdout[-2000:]
    for part in ("model", "optimizer", "scheduler"):
        assert_same_state(checkpoint(cut)[part], checkpoint(whole)[part], part)
    assert [r["lr"] for r in metrics(cut)] == [r["lr"] for r in metrics(whole)]
    record = json.loads((cut / "run-manifest.json").read_text())["record"]
    recorded = record.get("recipe", "")
    assert recorded.startswith("AdamW") if example == "recipe" else recorded == "", recorded
    # the task's AdamW and warm-up: --optimizer and --scheduler, unused, were recorded with their defaults
    assert ("optimizer" in record["flags"] and "scheduler" in record["flags"]) == (example != "recipe"), record
