"""Your own model and data (--task FILE): the worked example common/tasks/sequences.py, a transformer over token
sequences, gets what MNIST gets (exact-once evaluation at any world size, a mid-epoch stop that resumes
bit-identical, stage 05 resumed at another world size, with and without --amp), and a task file that is wrong
ends the run with one line naming it."""

import argparse
import os
import pickle
import re
import signal
from pathlib import Path

import pytest
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
    one_error,
    python,
    srun_like,
    stage_args,
    start,
    torchrun,
)
from test_preemption import SLOW, saved_mid_epoch, signal_mid_epoch_2

from common.guards import check, logits, pretrained, samples
from common.guards.ending import Refusal
from common.metrics import Epoch, Sums
from common.tasks import sequences

TASK = REPO / "common" / "tasks" / "sequences.py"
SAMPLES, BATCH = 256, 32  # as test_preemption's MNIST: 8 steps per epoch
TESTS = SAMPLES // 5  # 51 test sequences: 2 ranks do not divide them


def args(out, *extra):
    """Two epochs of the example task; its options as in the README. --data-dir: it reads none."""
    task = ["--task", TASK, "--samples", SAMPLES, "--dim", 16, "--layers", 2]
    return stage_args(REPO / "data", out, *task, "--epochs", 2, "--batch-size", BATCH, *extra)


def accuracy(output):
    """(correct, samples) of the last epoch line."""
    return tuple(map(int, re.findall(r"accuracy (\d+)/(\d+)", output)[-1]))


# the example task's run at 2 ranks in stage 03, exported, its test set in batches of 8 (uneven shares of the 51):
# trained once (conftest.py `uninterrupted`; the data's folder, which the task reads none of, is free), what the
# test that counts its test samples reads, and what the one stopped mid-epoch resumes to
SHARED = ("--save-model", "--test-batch-size", 8)


def whole_run(uninterrupted):
    task = ["--task", TASK, "--samples", SAMPLES, "--dim", 16, "--layers", 2]
    return uninterrupted(2, S03, *task, "--epochs", 2, "--batch-size", BATCH, *SHARED)


@pytest.mark.slow
def test_the_example_task_learns_in_an_epoch_in_stage_01(tmp_path):
    out = python(S01, *stage_args(REPO / "data", tmp_path, "--task", TASK, "--epochs", 1))
    assert out.returncode == 0, out.stderr[-2000:]
    correct, samples = accuracy(out.stdout)
    assert samples == 800 and correct > 0.8 * samples, out.stdout  # 4 classes: a quarter by chance


@pytest.mark.slow
def test_the_example_task_at_two_ranks_counts_every_test_sample_once(uninterrupted):
    run = whole_run(uninterrupted)
    stdout = Path(f"{run}.stdout").read_text()
    options = argparse.Namespace(samples=SAMPLES, seq_len=16, vocab=16, dim=16, layers=2, heads=2, seed=1, limit=None)
    model = sequences.model(options)
    model.load_state_dict(checkpoint(run, "model.pt"))
    tokens, labels = sequences.datasets(options)[1].tensors
    with torch.no_grad():
        correct = int((model.eval()(tokens).argmax(1) == labels).sum())
    assert len(labels) == TESTS and TESTS % 2 and accuracy(stdout) == (correct, TESTS), stdout


@pytest.mark.slow
def test_the_example_task_stopped_mid_epoch_at_two_ranks_resumes_bit_identical(uninterrupted, tmp_path):
    whole, cut = whole_run(uninterrupted), tmp_path / "cut"
    proc = start(S03, *args(cut, *SHARED), nproc=2, env=clean_env(**SLOW))
    output, _ = signal_mid_epoch_2(proc, cut, signal.SIGTERM)
    step = saved_mid_epoch(cut, output, proc.returncode, proc)
    resumed = torchrun(2, S03, *args(cut, *SHARED, "--resume"))
    assert resumed.returncode == 0 and f"resumed at epoch 2, step {step}" in resumed.stdout, resumed.stderr
    assert accuracy(resumed.stdout)[1] == TESTS
    assert_same_state(checkpoint(cut)["model"], checkpoint(whole)["model"])


@pytest.mark.slow
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_the_example_task_in_stage_05_at_two_ranks_resumes_at_one(amp, tmp_path):
    """Each transformer layer a block of its own, the head at the root; under --amp FSDP's bf16 meets the root's
    head after the last block. One rank: RANK set, as FSDP's mixed precision needs a process group."""
    extra = ["--amp"] if amp else []
    first = launched(2, S05, *args(tmp_path, "--epochs", 1, *extra))
    assert first.returncode == 0 and accuracy(first.stdout)[1] == TESTS, first.stderr[-2000:]
    resumed = launched(1, S05, *args(tmp_path, "--resume", *extra))
    assert resumed.returncode == 0 and "resumed after epoch 1" in resumed.stdout, resumed.stderr[-2000:]
    assert accuracy(resumed.stdout)[1] == TESTS
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert [row.split(",")[10] for row in rows[1:]] == ["2", "1"]  # the world size of each epoch


HEAD = "from common.tasks import sequences\nadd_arguments = sequences.add_arguments\n"  # the example's options
MODEL, DATA = "model = sequences.model\n", "datasets = sequences.datasets\n"
PAIR = "(training set, test set)"
BAD = {  # a task file, and what its error line says is wrong
    "a syntax error": ("def model(args)\n    return None\n", "line 1"),
    "no model()": (HEAD + DATA, "defines no model()"),
    "no datasets()": (HEAD + MODEL, "defines no datasets()"),
    "one data set": (HEAD + MODEL + "def datasets(args):\n    return sequences.datasets(args)[0]\n", PAIR),
    "no data sets": (HEAD + MODEL + "def datasets(args):\n    return None\n", PAIR),
    "items without labels": (
        HEAD + MODEL + "def datasets(args):\n"
        "    tokens = sequences.TensorDataset(sequences.sequences(8, 16, 16, 0)[0])\n"
        "    return tokens, tokens\n",
        "items are (input, label)",
    ),
    "float labels": (
        HEAD + MODEL + "def datasets(args):\n"
        "    tokens, labels = sequences.sequences(8, 16, 16, 0)\n"
        "    return (sequences.TensorDataset(tokens, labels.float()),) * 2\n",
        "a label of torch.float32",
    ),
    "a model that is no Module": (
        HEAD + DATA + "def model(args):\n    return sequences.model(args).state_dict()\n",
        "not a torch.nn.Module",
    ),
    "a model with no parameters": (
        HEAD + DATA + "import torch\ndef model(args):\n    return torch.nn.Flatten()\n",
        "model(args) has no parameter that requires a gradient",
    ),
    "a frozen model": (
        HEAD + DATA + "def model(args):\n    return sequences.model(args).requires_grad_(False)\n",
        "the loss depends on no parameter that requires a gradient: model(args) is frozen",
    ),
    "a model that ends in a softmax": (  # trained on another loss than the one it reported, with an accuracy
        HEAD
        + DATA
        + "import torch\ndef model(args):\n    return torch.nn.Sequential(sequences.model(args), torch.nn.Softmax(1))\n",
        "model(args) returns probabilities (a softmax's), but the default loss, cross-entropy, takes logits",
    ),
}


class Ends(torch.nn.Module):
    def __init__(self, end):
        super().__init__()
        self.fc, self.end = torch.nn.Conv2d(3, 4, 1), end

    def forward(self, x):
        return self.end(self.fc(x).mean((2, 3)) if x.shape[-1] == 1 else self.fc(x))


ENDINGS = {  # what a model ends in: refused for outputs (B, C), and (B, C, H, W)? Cross-entropy's classes: dim 1
    "nn.Softmax": (torch.nn.Softmax(dim=1), (True, True)),
    "F.softmax": (lambda x: torch.nn.functional.softmax(x, dim=1), (True, True)),
    "its implicit dim": (lambda x: torch.nn.functional.softmax(x), (True, True)),  # 1, for 2-D and 4-D alike
    "Tensor.softmax(-1)": (lambda x: x.softmax(-1), (True, False)),  # the last dim: a (B, C, H, W)'s is W
    "torch.softmax": (lambda x: torch.softmax(x, 1), (True, True)),
    "log_softmax": (lambda x: torch.nn.functional.log_softmax(x, 1), (False, False)),
    "logits": (lambda x: x, (False, False)),
    "a softmax, then its log": (lambda x: x.softmax(1).log(), (False, False)),
    "a softmax over the batch": (lambda x: x.softmax(0), (False, False)),
    "nn.Sigmoid": (torch.nn.Sigmoid(), (True, True)),  # probabilities too, each class's alone
    "a sigmoid, then its log": (lambda x: x.sigmoid().log(), (False, False)),
}


@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")  # torch's, of a form models still use
@pytest.mark.parametrize("spatial", [False, True], ids=["(B, C)", "(B, C, H, W)"])
@pytest.mark.parametrize("end", ENDINGS)
def test_a_model_that_returns_probabilities_is_refused_at_its_first_training_forward(end, spatial):
    """Cross-entropy reads its input as logits: a softmax's probabilities trained on another loss than the one
    reported, unsaid. What autograd recorded of the first training forward's output says so, before any backward;
    never a softmax inside the model, nor an evaluation's output (no graph), and the model is watched no more."""
    module, refused = ENDINGS[end]
    model, x = Ends(module), torch.zeros(2, 3, 5, 5) if spatial else torch.zeros(2, 3, 1, 1)
    logits.watch(model, "t.py")
    with torch.no_grad():
        model(x)  # an evaluation first (a run resumed in one): the training's forward is the one looked at
    if refused[spatial]:
        with pytest.raises(Refusal) as said:
            model(x)
        made = "a sigmoid's" if "igmoid" in end else "a softmax's"
        assert said.value.code.startswith(f"error: --task t.py: model(args) returns probabilities ({made})")
    else:
        model(x)
    assert not model._forward_hooks  # one look, then none: no cost a step


EVERYDAY = {"a missing file", "a syntax error", "a model that is no Module"}  # the others: make test-all


@pytest.mark.parametrize(
    "case",
    [c if c in EVERYDAY else pytest.param(c, marks=pytest.mark.slow) for c in ["a missing file", "a folder", *BAD]],
)
def test_a_wrong_task_file_is_one_line_naming_it(case, tmp_path):
    task = tmp_path / "my_task.py"
    if case in BAD:
        task.write_text(BAD[case][0])
    if case == "a folder":  # gave an AttributeError traceback: no loader for a folder
        task.mkdir()
    out = python(S01, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1))
    one_error(
        out, f"--task {task}", BAD.get(case, (None, "Is a directory" if case == "a folder" else "No such file"))[1]
    )


@pytest.mark.slow
def test_a_model_with_no_parameter_to_train_is_one_line_under_ddp_too(tmp_path):
    """Stage 03's DDP refuses it before the optimizer does (stages 01 and 05), in torch's words, on every rank: the
    task's model is named, once."""
    task = tmp_path / "my_task.py"
    task.write_text(BAD["a model with no parameters"][0])
    out = launched(2, S03, *stage_args(REPO / "data", tmp_path / "out", "--task", task, "--epochs", 1))
    one_error(out, f"--task {task}: model(args) has no parameter that requires a gradient")


STOPS = (
    HEAD
    + MODEL
    + """import itertools

CALLS = itertools.count()


class Stops(sequences.TensorDataset):
    def __getitem__(self, index):
        if next(CALLS) == 300:  # past the guard rails' look at every item: in the first epoch
            raise StopIteration  # as an iterator ends
        return super().__getitem__(index)


def datasets(args):
    training, test = sequences.datasets(args)
    return Stops(*training.tensors), test
"""
)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_data_set_that_raises_stopiteration_is_one_line_not_a_short_epoch(workers, tmp_path):
    """A StopIteration out of a task's __getitem__ ended the DataLoader's loop: the epoch was logged and saved as
    whole after 3 of its 8 batches, exit 0 (the next, of no batch, divided by zero in metrics.py)."""
    task = tmp_path / "stops.py"
    task.write_text(STOPS)
    out = python(S01, *args(tmp_path / "out", "--task", task, "--num-workers", workers))
    one_error(out, "StopIteration", f"(at {task}:")  # the task's line, in a worker or not
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_an_epoch_that_counted_fewer_samples_than_its_sets_is_one_line():
    """The guard rails' check of each epoch's sums: training at least every sample (padding adds), each evaluation
    every sample once; --dry-run trains one batch. A float32 sum counts exactly below 2^24 samples alone: a larger
    set is not checked (its count would be refused for a rounding)."""
    whole = Epoch(Sums(256.0, 0.0, 256.0), Sums(0.0, 0.0, 0.0), Sums(5.0, 4.0, 51.0))
    samples.check_counts(1, whole, (256, 0, 51), dry_run=False)
    samples.check_counts(1, whole._replace(training=Sums(1.0, 0.0, 258.0)), (256, 0, 51), dry_run=False)  # padded
    samples.check_counts(1, whole._replace(training=Sums(1.0, 0.0, 32.0)), (256, 0, 51), dry_run=True)
    samples.check_counts(1, whole._replace(training=Sums(1.0, 0.0, 2.0**24)), (2**24 + 1, 0, 51), dry_run=False)
    for part, short, said in (("training", 96.0, "training counted 96 of its 256"), ("test", 50.0, "test counted 50")):
        with pytest.raises(SystemExit, match=f"^error: epoch 1's {said}"):
            samples.check_counts(1, whole._replace(**{part: Sums(1.0, 0.0, short)}), (256, 0, 51), dry_run=False)


@pytest.mark.parametrize("returned", ["True", "['--hidden']"])
def test_a_task_check_that_returns_no_words_is_named(returned, tmp_path, capsys):
    """check(args) returns what is wrong, in words, or None: one that returns True (meaning "fine") or a list was
    printed as "error: True"; now the line says what check() returned and what it should."""
    task = tmp_path / "my_task.py"
    task.write_text(HEAD + MODEL + DATA + f"def check(args):\n    return {returned}\n")
    with pytest.raises(SystemExit) as stop:
        check.parse_args(["--task", str(task)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert f"error: the task's check(args) returned {returned}: it returns what is wrong" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("change", ["an option", "the task"])
def test_a_resume_with_another_task_or_task_option_is_refused_naming_it(change, tiny_data, tmp_path):
    first = python(S01, *args(tmp_path, "--epochs", 1))
    assert first.returncode == 0, first.stderr[-2000:]
    if change == "an option":
        out, named = python(S01, *args(tmp_path, "--resume", "--dim", 8)), ("--dim 16 (now 8)",)
    else:  # the built-in task, on MNIST: the example's options are not its own
        out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2, "--batch-size", BATCH, "--resume"))
        named = "--task sequences.py (sha256 ", "(now images.py (sha256 "  # each task by its content
    one_error(out, "checkpoint.pt was written with", *named)


GC_TASK = """import gc

import torch.nn.functional as F

from common.tasks.images import *  # noqa: F403
from common.tasks import images

FOLDER = []  # the output folder, for loss()


def model(args):
    FOLDER.append(args.output_dir)
    (args.output_dir / "gc-at-start-up").write_text(str(gc.get_threshold()[0]))
    return images.model(args)


def loss(output, target):
    (FOLDER[0] / "gc-in-training").write_text(str(gc.get_threshold()[0]))
    return F.cross_entropy(output, target)
"""


@pytest.mark.slow
def test_the_collector_runs_seldom_at_start_up_only(tiny_data, tmp_path):
    """The imports run with the collector every 20,000 new objects (common/guards/early.py); the training at
    Python's 700 again: a task's cyclic garbage holding a step's tensors is freed within steps, not hundreds."""
    out = tmp_path / "out"
    (tmp_path / "task.py").write_text(GC_TASK)
    done = python(S01, *stage_args(tiny_data, out, "--task", tmp_path / "task.py", "--epochs", 1))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(out / name).read_text() for name in ("gc-at-start-up", "gc-in-training")] == ["20000", "700"]


def weights_file(kind, folder):
    """A task's file of whole weights, as a hostile user leaves it."""
    path = folder / "whole.pt"
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind != "missing":
        state = sequences.Transformer(16, 16, 32, 2, 2).state_dict()
        torch.save({"epoch": 1, "model": state} if kind == "a training checkpoint" else state, path)
        whole = path.read_bytes()
        mangled = {"cut short": whole[: len(whole) // 2], "a plain pickle": pickle.dumps([1, 2])}
        path.write_bytes(mangled.get(kind, whole))
    return path


@pytest.mark.parametrize(
    "kind, named",
    [("a FIFO", "is not a regular file (a FIFO"), ("missing", "does not exist"),
     ("cut short", "is damaged or no file torch.save wrote (is not a complete zip archive"),
     ("a plain pickle", "is damaged or no file torch.save wrote (is not in torch.save's zip format)"),
     ("a training checkpoint", "holds no state dict, names of tensors (a training checkpoint?"), ("whole", None)],
)  # fmt: skip
@pytest.mark.parametrize("stage", ["01", "05"])
def test_a_weights_file_is_checked_before_a_stage_reads_it(kind, named, stage, tmp_path):
    """The task's weights(args), which every stage starts from (stage 05's rank 0 maps it): a FIFO blocked it for
    ever, a file cut short was torch's "central directory" error naming no file. Checked from its headers."""
    path = weights_file(kind, tmp_path)
    task = argparse.Namespace(weights=lambda args: str(path))  # a str, as a task may return
    args = argparse.Namespace(task=tmp_path / "task.py", **({"full_shard": False} if stage == "05" else {}))
    if named is None:
        pretrained.check_weights(args, task)
        return
    with pytest.raises(SystemExit) as stop:
        pretrained.check_weights(args, task)
    said = stop.value.code
    assert said.startswith(f"error: --task {tmp_path / 'task.py'}: its weights(args) file {path} {named}"), said
    assert said.endswith(": give a torch.save'd state dict of the task's model") and "\n" not in said, said


WEIGHTED = """
from common.tasks.images import add_arguments, check, datasets, model  # MNIST, from a file of whole weights

def weights(args):
    return {path!r}
"""


@pytest.mark.slow
def test_stage_05_with_a_weights_file_that_would_block_ends_in_one_line(tiny_data, tmp_path):
    """Two ranks, the task's weights(args) a FIFO: rank 0 blocked reading it for ever, rank 1 waited for its shards
    until --dist-timeout. Now rank 0's line ends both, in the seconds a start takes."""
    (tmp_path / "task.py").write_text(WEIGHTED.format(path=str(weights_file("a FIFO", tmp_path))))
    args = stage_args(tiny_data, tmp_path / "out", "--task", tmp_path / "task.py", "--epochs", 1)
    codes, outputs = srun_like(2, S05, *args, timeout=90)
    said = f"error: --task {tmp_path / 'task.py'}: its weights(args) file {tmp_path / 'whole.pt'} is not a regular file"
    errors = [[line for line in out.splitlines() if line.startswith("error:")] for out in outputs]
    assert codes == [1, 1] and len(errors[0]) == 1 and errors[0][0].startswith(said) and errors[1] == [], outputs
    assert "Traceback" not in "".join(outputs), outputs
