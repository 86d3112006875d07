"""The jobs people train beside the examples: batches of any structure (a task's collate(), dicts of tensors as
inputs and labels), the task's own metric (regression: MAE, no accuracy anywhere), BatchNorm evaluated and saved
alike on every rank, the worked example common/tasks/text.py stopped and resumed bit-identical, and one line
for each way such a task can be wrong."""

import argparse
import csv
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch
import torch.nn.functional as F
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
    run,
    stage_args,
    start,
)
from test_preemption import SLOW, saved_mid_epoch, signal_mid_epoch_2
from torch import nn
from torch.utils.data import default_collate

from common import cli, data
from common.guards import divergence, preflight, resume, samples
from common.metrics import Epoch, Log, Metric, Sums
from common.options import compiling, flags, holdout, large
from common.tasks import text

TEXT = REPO / "common" / "tasks" / "text.py"
SAMPLES, BATCH = 256, 32  # as test_preemption's MNIST: 8 steps per epoch
TESTS = SAMPLES // 5  # 51 test texts: 2 ranks do not divide them

# A regression with BatchNorm: float targets, MSE, and MAE as the metric. 45 test samples: 2 ranks do not divide them
REGRESSION = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

metric = ("mae", "lower")
TRAIN, TEST = {train}, {test}


def score(output, target):
    return (output.squeeze(1) - target).abs()  # one value per sample


def loss(output, target):
    return F.mse_loss(output.squeeze(1), target)


def model(args):
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def data():
    x = torch.randn(TRAIN + TEST, 4, generator=torch.Generator().manual_seed(0))
    return x, x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 3


def datasets(args):
    x, y = data()
    return TensorDataset(x[:TRAIN], y[:TRAIN]), TensorDataset(x[TRAIN:], y[TRAIN:])
"""


def regression(folder, train=256, test=45, extra=""):
    path = folder / "regression.py"
    path.write_text(REGRESSION.format(train=train, test=test) + extra)
    return path


def text_args(out, *extra):
    task = ["--task", TEXT, "--samples", SAMPLES, "--dim", 16, "--layers", 2]
    return stage_args(REPO / "data", out, *task, "--epochs", 2, "--batch-size", BATCH, *extra)


def accuracy(output):
    """(correct, samples) of the last epoch line."""
    return tuple(map(int, re.findall(r"accuracy (\d+)/(\d+)", output)[-1]))


# the text example's run at 2 ranks in stage 03, exported, its test set in batches of 8 (uneven shares of the 51):
# trained once (conftest.py `uninterrupted`; the data's folder, which the task reads none of, is free), what the
# test that counts its test texts reads, and what the one stopped mid-epoch resumes to
SHARED = ("--save-model", "--test-batch-size", 8)


def whole_run(uninterrupted):
    task = ["--task", TEXT, "--samples", SAMPLES, "--dim", 16, "--layers", 2]
    return uninterrupted(2, S03, *task, "--epochs", 2, "--batch-size", BATCH, *SHARED)


def load(path):
    """The task file at `path` as a module, as the stages load it."""
    from common import cli

    return cli.load_task(path)


@pytest.mark.slow
def test_regression_in_stage_05_at_two_ranks_prints_the_saved_models_mae_and_no_accuracy(tmp_path):
    """Float targets, the task's metric (MAE, lower is better) and BatchNorm under FSDP: the printed test MAE is the
    saved model's, whose running statistics every rank shares (each rank kept its own before)."""
    task = regression(tmp_path)
    out = launched(2, S05, *stage_args(REPO / "data", tmp_path, "--task", task, "--epochs", 1, "--batch-size", 32,
                                       "--lr", 0.5, "--save-model"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "accuracy" not in out.stdout and "| mae " in out.stdout, out.stdout
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "test_mae" in header and "val_mae" in header and not [h for h in header if "accuracy" in h], header
    row = metrics(tmp_path)[-1]
    assert row["better"] == "lower"
    module = load(task)
    model = module.model(None)
    model.load_state_dict(checkpoint(tmp_path, "model.pt"))
    x, y = module.data()
    with torch.no_grad():
        mae = float(module.score(model.eval()(x[256:]), y[256:]).sum()) / 45  # a value per sample
    printed = float(re.findall(r"\| mae (\S+)", out.stdout)[-1])
    assert float(row["test_mae"]) == pytest.approx(mae, rel=1e-5) and printed == pytest.approx(mae, abs=1e-4)


@pytest.mark.slow
def test_the_text_example_at_two_ranks_counts_every_test_text_once(uninterrupted):
    """Texts of different lengths, padded by the task's collate() into a dict of tokens and mask."""
    run = whole_run(uninterrupted)
    stdout = Path(f"{run}.stdout").read_text()
    options = argparse.Namespace(samples=SAMPLES, max_len=32, vocab=16, dim=16, layers=2, seed=1, limit=None)
    model = text.model(options)
    model.load_state_dict(checkpoint(run, "model.pt"))
    inputs, labels = text.collate(list(text.datasets(options)[1]))
    with torch.no_grad():
        correct = int((model.eval()(inputs).argmax(1) == labels).sum())
    assert len(labels) == TESTS and TESTS % 2 and accuracy(stdout) == (correct, TESTS), stdout


@pytest.mark.slow
def test_the_text_example_stopped_mid_epoch_at_two_ranks_resumes_bit_identical(uninterrupted, tmp_path):
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    proc = start(S03, *text_args(cut, *SHARED), nproc=2, env=clean_env(**SLOW))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    resumed = launched(2, S03, *text_args(cut, *SHARED, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    assert accuracy(resumed.stdout)[1] == TESTS
    cut, whole = checkpoint(cut), checkpoint(whole)
    for part in ("model", "optimizer", "scheduler"):  # every tensor; the logged training loss sums in another order
        assert_same_state(cut[part], whole[part], part)
    assert [r["test_accuracy"] for r in cut["log"]["rows"]] == [r["test_accuracy"] for r in whole["log"]["rows"]]


@pytest.mark.slow
def test_dict_inputs_and_dict_labels_in_stage_05_with_micro_batches(tmp_path):
    """Hugging Face-style samples: a dict of inputs and a dict of labels, split into --grad-accum micro-batches."""
    task = tmp_path / "dicts.py"
    task.write_text(
        "import torch\nfrom torch import nn\nfrom torch.nn import functional as F\nfrom common.tasks import text\n"
        "add_arguments, check, model = text.add_arguments, text.check, text.model\n"
        "def collate(samples):\n    inputs, labels = text.collate(samples)\n    return inputs, {'label': labels}\n"
        "def loss(output, target):\n    return F.cross_entropy(output, target['label'])\n"
        "metric = ('accuracy', 'higher')\n"
        "def score(output, target):\n    return output.argmax(1) == target['label']\n"
        "datasets = text.datasets\n"
    )
    args = stage_args(REPO / "data", tmp_path / "out", "--task", task, "--samples", SAMPLES, "--epochs", 1,
                      "--batch-size", BATCH, "--grad-accum", 2)  # fmt: skip
    out = launched(2, S05, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert accuracy(out.stdout)[1] == TESTS


@pytest.mark.slow
def test_a_metric_over_a_test_set_of_one_sample_at_two_ranks_is_finite(tmp_path):
    """Rank 1 has no test sample of its own: it adds nothing, and the mean is over the one sample."""
    out = launched(2, S03, *stage_args(REPO / "data", tmp_path, "--task", regression(tmp_path, test=1), "--epochs", 1))
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(metrics(tmp_path)[-1]["test_mae"]) < float("inf")


def test_the_target_of_a_lower_is_better_metric_is_reached_at_or_below_it(tmp_path):
    log = Log(tmp_path, 1, metric=Metric("mae", "lower", None))
    log.rows = [{"val_mae": "", "test_mae": 0.5}]
    assert holdout.reached(log, 0.5, 1) and not holdout.reached(log, 0.4, 1)
    accuracy_log = Log(tmp_path, 1, Metric())
    accuracy_log.rows = [{"val_accuracy": "", "test_accuracy": 90.0}]
    assert holdout.reached(accuracy_log, 90, 1) and not holdout.reached(accuracy_log, 91, 1)


def test_a_target_of_accuracy_outside_its_percent_is_one_line(tmp_path):
    """--target 0.95 on accuracy, in %: reached at the first evaluation, the run stopped as if it had trained to
    95 %; 150 was never reached. A task's metric of its own takes any target."""
    log = Log(tmp_path, 1, Metric())
    for target, said in ((0.95, r"0.95 % is reached at once \(did you mean 95\?\)"), (150, "150 % is never reached"),
                         (-5, "-5 % is reached at once$"), (0, "0 % is reached at once$")):  # fmt: skip
        with pytest.raises(ValueError, match=r"^--target -?[\d.]+: accuracy is in %, from 0 to 100: " + said):
            holdout.reached(log, target, 1)  # no hint where the target is no fraction: "did you mean -500?"
    assert not holdout.reached(log, 99, 1) and not holdout.reached(Log(tmp_path, 1, Metric("mae", "lower")), 0.5, 1)


def test_a_target_is_never_reached_in_an_epoch_resumed_part_way(tmp_path):
    """Stopped in epoch 2, resumed with --target 50: the stop came at once, "done: 1 epochs", and --save-model
    exported the weights of 9 steps into epoch 2 (81.17 %) beside epoch 1's row (85.39 %)."""
    log = Log(tmp_path, 1, Metric())
    log.rows = [{"epoch": 1, "val_accuracy": "", "test_accuracy": 85.39}]
    log.carried[2] = (1.5, Sums.zeros(torch.device("cpu")))  # the part of epoch 2 before the stop
    assert not holdout.reached(log, 50, 1)
    log.rows.append({"epoch": 2, "val_accuracy": "", "test_accuracy": 90.0})
    assert holdout.reached(log, 50, 1)  # once the epoch has ended


def test_compile_seconds_count_the_compilations_inside_the_epochs_training_alone(tmp_path, capsys):
    """The compiler's seconds while the model trains, its backward's too (compiled with grad off); an evaluation's
    compilation (in eval mode) counts nowhere. Spans clipped at the training's end subtracted an evaluation's start
    from the end before."""
    log, model = Log(tmp_path, 1, Metric()), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model.compile(backend="aot_eager")  # forward and backward compiled, no code generated
    handler = torch._dynamo.callback.callback_handler
    before = (list(handler.start_callbacks), list(handler.end_callbacks))
    try:
        compiling.timed(log, model)
        modes = []
        handler.register_start_callback(lambda *_: modes.append((model.training, torch.is_grad_enabled())))
        model.train()
        model(torch.randn(3, 4)).sum().backward()
        trained = log.compiled
        assert modes == [(True, True), (True, False)]  # the forward, then the backward, with grad off
        with torch.no_grad():
            model.eval()
            model(torch.randn(5, 4))  # another batch size and mode: compiled again, in the evaluation
    finally:
        handler.start_callbacks[:], handler.end_callbacks[:] = before
    assert 0 < trained == log.compiled
    sums = Sums(torch.tensor(1.0), torch.tensor([1.0]), torch.tensor(2.0))  # loss, score, samples
    log.epoch(1, 1.0, 10.0, Epoch(sums, sums, sums))
    assert log.rows[-1]["compile_seconds"] == trained and log.compiled == 0
    assert f"compile {trained:.1f} s" in capsys.readouterr().out


def test_a_one_output_model_counts_its_logit_above_zero_as_class_1():
    output, target = torch.tensor([[2.0], [-1.0], [0.5]]), torch.tensor([1.0, 0.0, 0.0])
    assert Metric().score(output, target) == 2


def test_nested_batches_are_moved_counted_split_and_cut():
    batch = ({"tokens": torch.ones(5, 3), "mask": [torch.zeros(5, 3, dtype=torch.bool)]}, torch.arange(5))
    moved = data.to_device(batch, torch.device("cpu"))
    assert data.count(moved[1]) == 5 and data.count(moved[0]) == 5
    parts = large.chunk(moved[0], 2)
    assert [data.count(p) for p in parts] == [3, 2] and parts[1]["mask"][0].shape == (2, 3)
    assert data.first(moved, 2)[0]["tokens"].shape == (2, 3)


def test_the_fingerprint_reads_every_tensor_of_nested_samples():
    class Dicts(torch.utils.data.Dataset):
        def __init__(self, value):
            self.value = value

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"ids": torch.tensor([i, self.value])}, {"label": torch.tensor(i)}

    assert preflight.fingerprint(Dicts(1)) == preflight.fingerprint(Dicts(1)) != preflight.fingerprint(Dicts(2))


def test_the_fingerprint_is_of_the_data_whatever_a_sample_holds():
    """numpy arrays and PIL images by their bytes, not their repr(): a PIL image's names its address, new in
    every process (the ranks never agreed, and no resume matched), and numpy's leaves out an array's middle (a
    change there resumed unseen). A value numpy cannot read counts by its type's name, the same everywhere."""
    from PIL import Image

    class Samples(torch.utils.data.Dataset):
        def __init__(self, middle=0):
            self.middle = middle

        def __len__(self):
            return 3

        def __getitem__(self, i):
            features = numpy.arange(2000, dtype=numpy.float32) + i
            features[100:1900] *= self.middle
            image = Image.fromarray(numpy.full((4, 4), i, dtype=numpy.uint8))
            return (features, image, object()), i

    assert preflight.fingerprint(Samples()) == preflight.fingerprint(Samples())
    assert preflight.fingerprint(Samples()) != preflight.fingerprint(Samples(middle=1))


def test_an_option_that_defaults_to_nan_is_the_same_on_every_rank_and_on_resume():
    """A task's `--clip` of default nan: nan != nan refused every resume and every launch of two ranks."""
    assert preflight.same(float("nan"), float("nan")) and preflight.same([1.0, float("nan")], [1.0, float("nan")])
    assert not preflight.same(float("nan"), 1.0) and preflight.same(1, 1.0)
    args = argparse.Namespace(**vars(cli.parse_args(["--epochs", "3"], [flags.add])[0]), clip=float("nan"))
    state = {"epoch": 1, "step": 0}
    assert resume.mismatch({"flags": preflight.defining(args)}, state, args, {"data": "data"}) is None


def flattened(samples):
    inputs, labels = default_collate(samples)
    return inputs, labels.view(-1)  # as a next-token loss takes them


@pytest.mark.parametrize(
    "change, problem",
    [({"metric": ("loss", "lower")}, "a metric named 'loss' would take the loss's columns in metrics.csv"),
     ({"collate": flattened}, "returns labels of shapes [4]: the stages count a batch's samples by its labels' first")],
    ids=["a metric named loss", "flattened labels"],
)  # fmt: skip
def test_a_task_that_would_log_wrong_numbers_is_refused(change, problem):
    """Labels flattened in collate(): an evaluation counted their tokens as samples and scored the first few alone;
    a metric named `loss`: its columns took the loss's place in metrics.csv. Both ran to exit 0 with wrong rows."""
    task = SimpleNamespace(**{"metric": ("mae", "lower"), "score": sum, "loss": sum} | change)
    pairs = torch.utils.data.TensorDataset(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(SystemExit, match=re.escape(problem)):
        preflight.check_datasets(SimpleNamespace(task="task.py", loader="batched"), task, pairs, pairs)


def test_a_resume_after_the_metric_was_renamed_says_so():
    """A task's metric renamed between a run and its resume (mae, then l1): the checkpoint's rows do not fit the
    new columns. Before: `ValueError: dict contains fields not in fieldnames` from the csv module."""
    before, after = (Log(Path("."), 1, metric=Metric(name, "lower")) for name in ("mae", "l1"))
    state = {"log": {"rows": [dict.fromkeys(before.fields, 0.0)]}}
    resume.same_columns(state, before.fields)  # the same task: nothing to say
    older = {"log": {"rows": [dict.fromkeys(set(before.fields) - {"compile_seconds"}, 0.0)]}}
    resume.same_columns(older, before.fields)  # a row of a version that had fewer columns: they stay empty
    resume.same_columns(None, after.fields)  # a fresh run
    with pytest.raises(
        SystemExit, match=re.escape("hold test_mae, val_mae, where this run's task logs test_l1, val_l1")
    ):
        resume.same_columns(state, after.fields)


def test_an_empty_data_set_is_named():
    """Before: `its test set's first item fails that (IndexError: index 0 is out of bounds ...)`."""
    pairs, empty = (torch.utils.data.TensorDataset(torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)) for n in (2, 0))
    with pytest.raises(SystemExit, match=re.escape("error: --task task.py: its test set is empty")):
        preflight.check_datasets(SimpleNamespace(task="task.py", loader="batched"), object(), pairs, empty)


def test_a_non_finite_score_is_never_logged(tmp_path):
    """A task's score() of inf (a relative error of a target of 0): the row and checkpoint were written with it."""
    sums = Epoch.read(torch.tensor([[1.0, 0, 8], [0, 0, 0], [1.0, float("inf"), 4]]))
    with pytest.raises(SystemExit, match=re.escape("non-finite test score (inf): the task's score() must sum")):
        divergence.check_epoch(1, sums, tmp_path, lambda value: pytest.fail(f"the losses are finite, not {value}"))


def test_a_loss_summed_over_the_batch_is_refused_before_the_first_step(tmp_path):
    """A task's loss() with reduction="sum": the stages weigh each batch's loss by its samples and DDP averages the
    ranks' gradients, so every number followed the batch and the world size (a test loss of 197 at 2 ranks where
    stage 01 said 77, 807 at one --test-batch-size and 19 at another), unsaid. One line before the first step; the
    mean, and a number beside the batch (an auxiliary loss), pass; the model's mode and the generators are kept."""
    model, x = nn.Linear(4, 1), torch.randn(2, 4)
    y = torch.randn(2)

    def summed(output, target):
        return F.mse_loss(output.squeeze(1), target, reduction="sum")

    def with_aux(output, target):
        prediction, aux = output
        return F.mse_loss(prediction.squeeze(1), target) + aux

    model.train()
    with pytest.raises(SystemExit, match=r"error: --task t.py: its loss\(\) sums over the batch \([\d.]+ on two"):
        samples.check_mean(model, summed, (x, y), "t.py")
    before = torch.get_rng_state()
    samples.check_mean(model, lambda output, target: F.mse_loss(output.squeeze(1), target), (x, y), "t.py")
    assert model.training and torch.equal(torch.get_rng_state(), before)

    class Aux(nn.Linear):
        def forward(self, x):
            return super().forward(x), torch.tensor(0.5)

    samples.check_mean(Aux(4, 1), with_aux, (x, y), "t.py")
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", regression(tmp_path, extra=SUMMED)))
    one_error(out, "its loss() sums over the batch", 'reduction="mean"')
    assert not (tmp_path / "out" / "metrics.csv").exists()


EXPERTS = """
import torch
from torch import nn
import torch.nn.functional as F

EXPERTS = 8

class Mixture(nn.Module):  # a router over experts; beside the logits, each expert's share of the batch
    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(784, EXPERTS), nn.ModuleList(nn.Linear(784, 10) for _ in range(EXPERTS))

    def forward(self, x):
        x = x.flatten(1)
        share = self.router(x).softmax(-1)
        logits = (share.unsqueeze(-1) * torch.stack([e(x) for e in self.experts], 1)).sum(1)
        return logits, share.mean(0)

def model(args):
    return Mixture()

def loss(output, target):
    logits, load = output
    return F.cross_entropy(logits, target) + EXPERTS * (load**2).sum()
"""


def test_a_model_output_beside_the_batch_is_refused_before_the_first_step(tmp_path):
    """A tensor a model returns that is no row per sample (a mixture's load per expert, a class's weights) was cut to
    the evaluation's batch as the rows are: the test loss 1.56 for 2.20 at --test-batch-size 5, unsaid (or a class
    said missing from a model of 10). One line before the first step; a 0-dim number beside the batch passes."""
    x, y = torch.randn(2, 4), torch.randn(2)

    class Load(nn.Linear):
        def forward(self, x):
            return super().forward(x), torch.ones(8)

    def mean(output, target):
        return F.mse_loss(output[0].squeeze(1), target) + output[1].sum()

    with pytest.raises(SystemExit, match=r"returns a tensor of shape \[8\] for 2 samples: each tensor .*batch first"):
        samples.check_mean(Load(4, 1), mean, (x, y), "t.py")
    task = tmp_path / "experts.py"
    task.write_text("from common.tasks.images import add_arguments, check, datasets\n" + EXPERTS)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--test-batch-size", 5))
    one_error(
        out, f"--task {task}: model(args) returns a tensor of shape [8] for 2 samples", "compute the rest in loss()"
    )
    assert not (tmp_path / "out" / "metrics.csv").exists()


SUMMED = """
def loss(output, target):
    return F.mse_loss(output.squeeze(1), target, reduction="sum")
"""


UNLABELLED = """import torch
from torch import nn
from torch.utils.data import TensorDataset
metric = ("labelled", "higher")
def pairs(n, unlabelled):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
    y = (x[:, 0] > 0).long()
    y[unlabelled] = -100  # nothing to learn from: prompt tokens alone, as masked fine-tuning data has
    return TensorDataset(x, y)
def datasets(args):
    return pairs(16, [5]), pairs(3, [2])
def model(args):
    return nn.Linear(4, 2)
def totals(output, target):
    labelled = target != -100
    return torch.stack([((output.argmax(1) == target) & labelled).sum(), labelled.sum()]).float()
def figure(totals):
    return 100 * totals[0] / totals[1]
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["test", "training"])
def test_a_batch_with_nothing_labelled_is_named_not_called_a_divergence(where, tmp_path):
    """A batch whose labels are all -100 (a test batch of the last, unlabelled sample; a training batch of one):
    the default loss, cross-entropy, is nan there with a gradient of 0 and the weights finite, and the run stopped
    saying it diverged, to try a lower --lr. It names the batch's loss; a true divergence is still one."""
    (tmp_path / "t.py").write_text(UNLABELLED)
    extra = ("--test-batch-size", 2) if where == "test" else ("--batch-size", 1, "--log-interval", 1)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", tmp_path / "t.py", "--epochs", 1, *extra))
    said = (
        "ended with a non-finite test loss (nan)" if where == "test" else "the training loss is not finite by epoch 1"
    )
    one_error(out, said, "the weights are finite, so the run did not diverge", "labels are all -100")
    assert "try a lower --lr" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, said",
    [
        (("--lr", "1e10", "--limit", 1000, "--log-interval", 1), "the training loss is not finite by epoch 1, batch 3"),
        (("--lr", "1e11", "--limit", 200, "--batch-size", 200), "epoch 1 ended with a non-finite test loss (nan)"),
    ],
)
def test_a_divergence_whose_weights_are_still_finite_is_called_one(extra, said, tmp_path):
    """MNIST at --lr 1e10: the weights grow huge but finite, and the losses overflow first (a sum of losses of 1e36,
    logits that make cross-entropy nan). The run said it did not diverge, and to write a loss() of one's own for
    labels of -100 that MNIST has none of. The model's outputs on two training samples, or a sum that is infinite
    (over no label the default loss is nan, never inf), name the divergence and its fix."""
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--epochs", 1, *extra))
    one_error(out, said, "the weights are finite, but the model's outputs or losses overflow", "try a lower --lr")
    assert "-100" not in out.stderr


def test_a_model_output_with_a_number_beside_the_batch_is_evaluated():
    """A model returning (prediction, a 0-dim auxiliary loss), as mixtures of experts do: the evaluation cuts the
    batch's padding off the prediction and keeps the number (it failed after the epoch's training)."""
    prediction, aux = data.first((torch.ones(5, 2), torch.tensor(0.5)), 3)
    assert prediction.shape == (3, 2) and aux.item() == 0.5


def test_a_data_set_of_the_users_with_a_subset_attribute_is_split():
    class Named(torch.utils.data.TensorDataset):
        subset = "train"  # a name, not common/data.py Images' method

    train, val = holdout.split(Named(torch.arange(10.0)), 0.2, seed=1)
    assert (len(train), len(val)) == (8, 2) and isinstance(val, torch.utils.data.Subset)


STREAM = (
    "import torch\nfrom torch.utils.data import IterableDataset\nfrom common.tasks import sequences\n"
    "model = sequences.model\nadd_arguments = sequences.add_arguments\n"
    "class Stream(IterableDataset):\n    def __iter__(self):\n        yield torch.zeros(16, dtype=torch.long), 0\n"
    "def datasets(args):\n    return Stream(), Stream()\n"
)
VARIABLE = (
    "from common.tasks import text\nadd_arguments, check, model, datasets = text.add_arguments, text.check, "
    "text.model, text.datasets\n"
)
OUTSIDE = "\ndef datasets(args):\n    x, y = data()\n    return TensorDataset(x, (y > 3).long() * 7), TensorDataset(x, (y > 3).long())\n"  # noqa: E501
BAD = {  # a task file (or its parts), what the error line names
    "an IterableDataset": (STREAM, ["IterableDataset", "needs indices", "map-style Dataset"]),
    "texts of different lengths and no collate()": (VARIABLE, ["stacking fails", "of shapes [([", "define collate"]),
    "a collate() returning a dict": (
        VARIABLE + "def collate(samples):\n    return text.collate(samples)[0]\n",
        ["must return a pair (inputs, labels)", "'tokens'"],
    ),
    "a collate() that fails": (
        VARIABLE + "def collate(samples):\n    raise ValueError('no padding here')\n",
        ["its collate() fails", "no padding here", "of shapes [(["],
    ),
    "labels outside the model's outputs": (None, ["a label 7", "has 2 outputs"]),
    "a metric without score()": (None, ["metric = (name", "score(output, target)"]),
    "a batch of one sample through BatchNorm": (None, ["batch of one sample", "BatchNorm"]),
}
EVERYDAY = {"texts of different lengths and no collate()"}  # the others in make test-all


@pytest.mark.parametrize("case", [c if c in EVERYDAY else pytest.param(c, marks=pytest.mark.slow) for c in BAD])
def test_a_task_whose_batches_do_not_fit_is_one_line_naming_it(case, tmp_path):
    source, words = BAD[case]
    extra = []
    if case == "labels outside the model's outputs":  # two outputs (the model's last layer), labels 0 and 7
        task = regression(tmp_path, extra=OUTSIDE)
        task.write_text(task.read_text().replace("nn.Linear(16, 1)", "nn.Linear(16, 2)").replace("def loss", "def _loss")
                        .replace('metric = ("mae", "lower")', "").replace("def score", "def _score"))  # fmt: skip
    elif case == "a metric without score()":
        task = regression(tmp_path)
        task.write_text(task.read_text().replace("def score", "def _score"))
    elif case == "a batch of one sample through BatchNorm":
        task, extra = regression(tmp_path, train=33), ["--batch-size", 32]
    else:
        task = tmp_path / "my_task.py"
        task.write_text(source)
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1, *extra))
    one_error(out, f"--task {task}", *words)


@pytest.mark.slow
def test_sync_bn_without_gpus_is_refused_by_check(tmp_path):
    out = python(S03, "--sync-bn", "--check", "--output-dir", tmp_path)
    one_error(out, "--sync-bn needs GPUs")
    assert out.returncode == 2


@pytest.mark.slow
def test_plan_counts_a_model_with_batchnorm(tmp_path):
    """BatchNorm refuses to train on one sample: the planner measures at per-rank batches of 2 and 3."""
    out = run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "tools" / "plan.py"), "--task",
               str(regression(tmp_path)), "--batch-size", "8"])  # fmt: skip
    assert out.returncode == 0 and "#SBATCH --gres=gpu:1" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_the_tools_read_the_metric_a_run_measured(tmp_path):
    """tools/scaling.py: the time to the task's metric reaching --target, in its direction."""
    rows = [dict(epoch=e, lr=1, train_loss=1, val_loss="", val_mae="", test_loss=1, test_mae=mae, epoch_seconds=10,
                 images_per_s=100, images_per_s_per_process=100, world_size=1, nodes=1, peak_memory_mib="",
                 compile_seconds=0, better="lower") for e, mae in ((1, 0.5), (2, 0.2))]  # fmt: skip
    (tmp_path / "run").mkdir()
    with open(tmp_path / "run" / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    scaling = [str(REPO / ".venv" / "bin" / "python"), str(REPO / "tools" / "scaling.py"), str(tmp_path / "run")]
    out = run([*scaling, "--target", "0.3"])
    assert out.returncode == 0 and "time to mae 0.3" in out.stdout and "| 20.0 s |" in out.stdout, out.stderr
    assert "accuracy" not in out.stdout
    one_error(run(scaling), "measure mae", "--target")
