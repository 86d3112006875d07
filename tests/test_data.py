"""The data sets and input pipelines: the same batches whichever --loader and data set; the split; every
file checked before it is read (common/guards/datafiles.py); and `make data` (tools/prepare_data.py)."""

import errno
import io
import json
import pickle
import re
import shutil
import sys
from types import SimpleNamespace
from urllib.error import URLError

import pytest
import torch
from helpers import INJECT, REPO, S03, TEST_SIZE, TRAIN_SIZE, clean_env, run, stage_args, torchrun_cmd, write_idx_subset
from torch.utils.data.distributed import DistributedSampler

from common import cli, data
from common.guards import check, datafiles, preflight
from common.options import flags, holdout, loaders

sys.path.insert(0, str(REPO / "tools"))  # tools/prepare_data.py, as `make data` runs it
import prepare_data  # noqa: E402

CPU = torch.device("cpu")


def batches(dataset, sampler, loader, batch_size=8):
    args = SimpleNamespace(loader=loader, num_workers=0, seed=1)
    return list(loaders.loader(dataset, sampler, batch_size, CPU, args))


@pytest.mark.parametrize("name, held_out", [("mnist", 0), ("cifar10", 0), ("cifar10", 0.25)])
@pytest.mark.parametrize("loader", ["classic", "device"])
def test_every_loader_gives_the_batches_of_the_default(loader, name, held_out, tiny_sets):
    """Same sampler, same batches: the pipelines differ in speed, not in what the model sees; grey or
    colour images, a whole set or the training part of a split."""
    train = data.dataset(tiny_sets, name, train=True)
    train = holdout.split(train, held_out, seed=3)[0] if held_out else train
    sampler = DistributedSampler(train, num_replicas=3, rank=1, seed=7)  # a shard, as a DDP rank draws it
    sampler.set_epoch(2)
    reference = batches(train, sampler, "batched")
    assert sum(len(y) for _, y in reference) == len(sampler) == -(-len(train) // 3)
    for (x, y), (ref_x, ref_y) in zip(batches(train, sampler, loader), reference, strict=True):
        assert torch.equal(y, ref_y)
        torch.testing.assert_close(x, ref_x, rtol=0, atol=1e-5)  # ToTensor()/Normalize() round differently


@pytest.mark.slow
def test_stage01s_default_path_never_imports_torchvision(tiny_data, tmp_path):
    """A run of stage 01 with the batched loader, in a fresh interpreter, ends without torchvision loaded: it
    doubles the time torch takes to import, which every rank would pay. --help imports less than a run."""
    code = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
    code += "sys.exit('torchvision' in sys.modules)"
    args = stage_args(tiny_data, tmp_path, "--epochs", 1, "--dry-run")
    out = run([sys.executable, "-c", code, "01_single_gpu/train.py", *args])
    assert out.returncode == 0 and "done: 1 epochs" in out.stdout, out.stdout + out.stderr


def test_prepare_checks_and_unpacks_the_vendored_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    prepare_data.prepare(tmp_path)
    assert len(data.dataset(tmp_path, "mnist", train=False)) == 10_000
    corrupt = raw / "t10k-labels-idx1-ubyte"
    corrupt.write_bytes(corrupt.read_bytes()[:-1] + b"\x00")
    with pytest.raises(SystemExit, match="sha256"):
        prepare_data.prepare(tmp_path)


def test_prepare_into_another_folder_takes_the_vendored_mnist_offline(monkeypatch, tmp_path):
    """`make data DATA_DIR=/scratch/...`: MNIST was downloaded (offline: six lines of mirrors' errors) though the
    repository holds it."""
    monkeypatch.setattr(prepare_data, "download", lambda *args: pytest.fail("no download: the repository has it"))
    prepare_data.prepare(tmp_path / "scratch")
    assert len(data.dataset(tmp_path / "scratch", "mnist", train=True)) == 60_000


def test_a_truncated_download_is_named_and_leaves_no_part_file(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw)
    cut = raw / "train-images-idx3-ubyte.gz"
    cut.write_bytes(cut.read_bytes()[:100_000])  # a download cut short
    with pytest.raises(
        SystemExit, match=f"{cut} is damaged .*: delete {cut}, then run `python tools/prepare_data.py "
    ) as e:
        prepare_data.prepare(tmp_path)  # its folder's own command: `make data` writes data/ alone
    assert str(e.value).endswith(f"prepare_data.py {tmp_path}`: it copies the repository's own again")  # a whole line
    assert not list(raw.glob("*.part"))


def test_prepare_blames_the_disk_not_the_archive_and_never_the_repositorys_copy(monkeypatch, tmp_path, capsys):
    """A full disk (or a file-size limit) while unpacking said the .gz "is damaged: delete it", which in data/ is the
    repository's only offline copy; a .gz of other data looped: its file deleted, the same .gz unpacked it again; and
    `prepare_data.py cifar10` prepared MNIST into ./cifar10."""
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        (tmp_path / "MNIST" / "raw").mkdir(parents=True, exist_ok=True)
        shutil.copy(gz, tmp_path / "MNIST" / "raw")

    class Full(io.FileIO):
        def write(self, chunk):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare_data, "open", lambda path, mode: Full(path, mode), raising=False)
    with pytest.raises(SystemExit, match=r"^error: cannot write .*\.part: No space left on device: free some space"):
        prepare_data.prepare(tmp_path)
    monkeypatch.undo()
    assert len(list((tmp_path / "MNIST" / "raw").glob("*.gz"))) == 4  # nothing to delete: they are whole
    vendored = REPO / "data" / "MNIST" / "raw"
    assert "restore the repository's t10k-labels-idx1-ubyte.gz (git checkout -- data/MNIST/raw/)" in (
        prepare_data.fetch(vendored, "t10k-labels-idx1-ubyte")
    )
    raw = tmp_path / "MNIST" / "raw"
    shutil.copy(raw / "t10k-labels-idx1-ubyte.gz", raw / "train-labels-idx1-ubyte.gz")  # another file's data
    with pytest.raises(SystemExit, match="not MNIST's") as bad:
        prepare_data.prepare(tmp_path)
    for path in (raw / "train-labels-idx1-ubyte", raw / "train-labels-idx1-ubyte.gz"):  # as the line says
        assert str(path) in str(bad.value.code)
        path.unlink()
    prepare_data.prepare(tmp_path)  # copied from the repository again: ready
    assert "MNIST ready" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        prepare_data.parse(["cifar10"])
    assert usage.value.code == 2 and "cifar10 is read as DATA_DIR" in capsys.readouterr().err


def test_files_torchvision_cannot_read_are_named_apart_from_a_download_that_failed(monkeypatch, tmp_path):
    """Fashion-MNIST's folder holding files cut short or of another kind: torchvision reads them instead of
    downloading, and the line said "cannot download ... run it on a machine with internet access", where the same
    would happen (or a catch-all AssertionError line naming no file)."""
    datasets = pytest.importorskip("torchvision.datasets")
    (tmp_path / "FashionMNIST" / "raw").mkdir(parents=True)
    for raised, said in ((RuntimeError("Error downloading t10k.gz:"), "cannot download fashion-mnist"),
                         (AssertionError(), f"{tmp_path / 'FashionMNIST' / 'raw'} holds files torchvision cannot read"),
                         (RuntimeError("shape '[60000, 28, 28]' is invalid"), "holds files torchvision cannot read")):  # fmt: skip
        monkeypatch.setattr(
            datasets, "FashionMNIST", lambda *args, raised=raised, **kwargs: (_ for _ in ()).throw(raised)
        )
        if "holds" in said:
            (tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"junk")
        with pytest.raises(SystemExit, match=re.escape(said)):
            prepare_data.download("fashion-mnist", tmp_path, train=True)


@pytest.mark.parametrize("loader", ["batched", "classic", "device"])
def test_an_empty_validation_set_yields_nothing(loader, tiny_data):
    """Without --val-fraction the validation set is empty ([], as the stages make it), and every pipeline,
    the lesson's and the options', must take that in stride."""
    assert batches([], range(0), loader) == [] and list(data.loader([], range(0), 8, CPU)) == []


@pytest.mark.parametrize("train", [True, False])
def test_the_idx_reader_returns_torchvisions_tensors(train, tiny_data):
    from torchvision import datasets  # here: each test process would otherwise import it while collecting

    ours = data.dataset(tiny_data, "mnist", train=train)
    reference = datasets.MNIST(tiny_data, train=train, download=False)
    assert ours.images.dtype == torch.uint8 and ours.labels.dtype == torch.int64
    assert torch.equal(ours.images, reference.data.unsqueeze(1)) and torch.equal(ours.labels, reference.targets)


def refused(data_dir, name, path, train=True):
    """The guard rails' check of the set, before the lesson reads it, must stop with one line naming the broken
    file and the command that prepares it in its folder; so must a stage's start, which runs it (check.check_args())."""
    fix = re.escape(f"run `python tools/prepare_data.py {data_dir} {name}` again")  # its folder's own, data/'s too
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: .*{fix}") as refusal:
        datafiles.check_set(data_dir, name, train=train)
    assert "\n" not in str(refusal.value)
    args = cli.parse_args(["--dataset", name, "--data-dir", str(data_dir), "--model", "cnn"], [flags.add])[0]
    with pytest.raises(SystemExit) as stop:
        check.check_args(args, warn=False, gpus=0)
    assert stop.value.code == f"error: {refusal.value}"
    return str(refusal.value)


@pytest.mark.parametrize(
    "file, change, problem",
    [
        ("train-images-idx3-ubyte", lambda raw: raw[:-1], "bytes, not the"),  # truncated
        ("train-images-idx3-ubyte", lambda raw: b"\x1f\x8b" + raw[2:], "not an IDX file"),  # still gzipped
        ("train-labels-idx1-ubyte", lambda raw: raw[:3] + b"\x03" + raw[4:], "not an IDX file"),  # not labels
        ("train-labels-idx1-ubyte", lambda raw: raw[:8] + bytes([12]) + raw[9:], "label 12 of image 0"),
    ],
    ids=["truncated", "wrong magic number", "images as labels", "label 12"],
)
def test_a_corrupt_idx_file_names_itself_and_make_data(file, change, problem, tiny_data, tmp_path):
    shutil.copytree(tiny_data / "MNIST", tmp_path / "MNIST")
    path = tmp_path / "MNIST" / "raw" / file
    path.write_bytes(change(path.read_bytes()))
    assert problem in refused(tmp_path, "mnist", path)


def test_a_labels_file_shorter_than_its_images_is_refused(tiny_data, tmp_path):
    """A well-formed labels file one record short: loading it would silently train on a subset."""
    shutil.copytree(tiny_data / "MNIST", tmp_path / "MNIST")
    path = tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    write_idx_subset(REPO / "data" / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz", path, TRAIN_SIZE - 1)
    assert f"{TRAIN_SIZE - 1} labels for {TRAIN_SIZE} images" in refused(tmp_path, "mnist", path)


@pytest.mark.parametrize("file", ["t10k-labels-idx1-ubyte", "t10k-images-idx3-ubyte"], ids=["labels", "images"])
def test_a_task_without_dataset_has_its_files_checked_too(file, tiny_data, tmp_path):
    """common/tasks/augmented.py reads MNIST through data.dataset() and has no --dataset: a test labels file one
    short tested on fewer images without a word, a truncated images file was numpy's reshape error naming none."""
    shutil.copytree(tiny_data / "MNIST", tmp_path / "MNIST")
    path = tmp_path / "MNIST" / "raw" / file
    short = TEST_SIZE - 1 if "labels" in file else TEST_SIZE
    write_idx_subset(REPO / "data" / "MNIST" / "raw" / f"{file}.gz", path, short)
    path.write_bytes(path.read_bytes()[: None if "labels" in file else -1])
    args = cli.parse_args(
        ["--task", str(REPO / "common/tasks/augmented.py"), "--data-dir", str(tmp_path)], [flags.add]
    )[0]
    with pytest.raises(SystemExit) as stop:
        check.check_args(args, warn=False, gpus=0)
    fix = re.escape(f"run `python tools/prepare_data.py {tmp_path} mnist` again")  # `make data` writes data/ alone
    assert re.match(f"error: {re.escape(str(path))}: .*{fix}", stop.value.code)


def cifar_batch(labels, images=None):
    images = torch.zeros(len(labels), 3 * 32 * 32, dtype=torch.uint8) if images is None else images
    return pickle.dumps({b"data": images.numpy(), b"labels": labels}, protocol=4)  # as conftest writes them


@pytest.mark.parametrize(
    "content, problem",
    [
        (cifar_batch([0, 1, 2])[:-20], "not a CIFAR batch"),  # truncated
        (pickle.dumps({b"data": torch.zeros(2, 3072, dtype=torch.uint8).numpy()}, protocol=4), "b'labels'"),
        (cifar_batch([0, 1], torch.zeros(2, 3072 - 1, dtype=torch.uint8)), "not uint8 N x 3072"),
        (cifar_batch([0, 1, 2], torch.zeros(2, 3072, dtype=torch.uint8)), "3 labels for 2 images"),
        (cifar_batch([0, 10, 2]), "label 10 of image 1"),
        (cifar_batch([0, -1]), "label -1 of image 1"),
    ],
    ids=["truncated", "no labels", "3071 pixels", "labels longer", "label 10", "label -1"],
)
def test_a_corrupt_cifar_batch_names_itself_and_make_data(content, problem, tiny_sets, tmp_path):
    shutil.copytree(tiny_sets / "cifar-10-batches-py", tmp_path / "cifar-10-batches-py")
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(content)
    assert len(data.dataset(tmp_path, "cifar10", train=True)) == 40  # the other files still load
    assert problem in refused(tmp_path, "cifar10", path, train=False)


def test_the_fingerprint_follows_labels_and_sampled_images():
    count = 3000  # a sample of 1,000: every third image
    images = torch.randint(256, (count, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(count) % 10

    def fingerprint(images, labels):
        return preflight.fingerprint(data.Images("numbers", images, labels, (0.5,), (0.25,), 10))

    reference = fingerprint(images, labels)
    assert fingerprint(images.clone(), labels.clone()) == reference  # equal data, equal fingerprints
    assert reference.startswith(f"{count}-") and len(reference) < 30
    other_label, other_image = labels.clone(), images.clone()
    other_label[1234] = (labels[1234] + 1) % 10
    other_image[3 * 123, 0, 2, 1] ^= 1  # one bit of one sampled image
    assert len({reference, fingerprint(images, other_label), fingerprint(other_image, labels)}) == 3
    assert fingerprint(images[1:], labels[1:]) != reference


def test_ranks_reading_the_same_files_agree_on_the_fingerprint(tiny_sets):
    """What the stages compare: every set read twice, whole and split, gives the same fingerprints."""
    for name in ("mnist", "fashion-mnist", "cifar10", "cifar100"):
        first, second = (holdout.split(data.dataset(tiny_sets, name, train=True), 0.25, seed=1) for _ in range(2))
        assert [preflight.fingerprint(part) for part in first] == [preflight.fingerprint(part) for part in second]
        assert preflight.fingerprint(first[0]) != preflight.fingerprint(first[1])


def test_split_is_seeded_disjoint_and_complete():
    count = 100
    images = torch.arange(count, dtype=torch.uint8).view(count, 1, 1, 1).expand(count, 1, 4, 4).contiguous()
    whole = data.Images("numbers", images, torch.arange(count), (0.5,), (0.25,), count)
    train, val = holdout.split(whole, 0.2, seed=1)
    assert (len(train), len(val)) == (80, 20) and type(train) is type(val) is data.Images
    assert sorted(torch.cat([train.labels, val.labels]).tolist()) == list(range(count))
    for part in train, val:
        assert torch.equal(part.images[:, 0, 0, 0].long(), part.labels)  # each image kept its label
        assert (part.mean, part.std, part.classes, part.image_size) == (whole.mean, whole.std, count, 4)
    assert torch.equal(holdout.split(whole, 0.2, seed=1)[1].labels, val.labels)
    assert not torch.equal(holdout.split(whole, 0.2, seed=2)[1].labels, val.labels)


def test_a_missing_set_names_its_folder_and_the_command_that_prepares_it_there(tmp_path):
    """It said `make data DATASET=cifar100`, which writes the repository's data/ alone, whatever --data-dir was; and
    for MNIST, "on a machine with internet access", which it does not need."""
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'cifar-100-python'} .*`python tools/prepare_data.py "
                       f"{tmp_path} cifar100` \\(it downloads all but MNIST"):  # fmt: skip
        data.dataset(tmp_path, "cifar100", train=True)


def test_a_crafted_cifar_batch_runs_no_code(tiny_sets, tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").symlink_to(tiny_sets / "cifar-100-python" / "train")
    (folder / "test").write_bytes(pickle.dumps({b"data": Payload()}))
    assert len(data.dataset(tmp_path, "cifar100", train=True)) == 8
    with pytest.raises(ValueError, match="not allowed"):
        data.dataset(tmp_path, "cifar100", train=False)
    assert not (tmp_path / "ran").exists()


def test_prepare_offline_says_where_to_run_it(monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise URLError("no network")

    from torchvision import datasets  # here: collecting the tests imports no torchvision

    monkeypatch.setattr(datasets, data.SETS["cifar10"].download, offline)
    with pytest.raises(
        SystemExit, match=f"cannot download cifar10 .*`python tools/prepare_data.py {tmp_path} cifar10`"
    ):
        prepare_data.prepare(tmp_path, "cifar10")


# 11: forgetting sampler.set_epoch
@pytest.mark.slow
def test_each_epoch_reshuffles_and_covers_the_data_once(tiny_data, tmp_path):
    record = tmp_path / "samples.jsonl"
    out = run(torchrun_cmd(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 2)),
              env=clean_env(PYTHONPATH=INJECT, RECORD_SAMPLES=record))  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    by_epoch = {e: [s for s in seen if s["epoch"] == e] for e in (1, 2)}
    for shards in by_epoch.values():
        assert sorted(sum((s["indices"] for s in shards), [])) == list(range(TRAIN_SIZE))
    order = {e: {s["rank"]: s["indices"] for s in shards} for e, shards in by_epoch.items()}
    assert order[1][0] != order[2][0]
