"""Fixtures for every test: tiny data sets in their real on-disk formats."""

import fcntl
import hashlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    TEST_SIZE,
    TRAIN_SIZE,
    free_port,
    launched,
    python,
    shared,
    spawn,
    stage_args,
    write_idx_subset,
)

CIFAR_BATCH = 8  # images per CIFAR file: 40 training images in CIFAR-10's five batches, 8 test images

# one thread for what the tests compute in their own process, as clean_env gives the processes they start: the
# test workers of `make test` and the ranks they launch share the cores instead of fighting over them
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A --data-dir holding the first images of real MNIST as uncompressed IDX files, as `make data` leaves them."""
    root = tmp_path_factory.mktemp("data")
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", TRAIN_SIZE), ("t10k", TEST_SIZE)):
        for kind in ("images-idx3", "labels-idx1"):
            name = f"{split}-{kind}-ubyte"
            write_idx_subset(REPO / "data" / "MNIST" / "raw" / f"{name}.gz", raw / name, count)
    return root


def write_idx(path, array):
    """A uint8 array as an IDX file: two zero bytes, 0x08 (unsigned bytes), the rank, big-endian sizes, data."""
    sizes = b"".join(size.to_bytes(4, "big") for size in array.shape)
    path.write_bytes(bytes([0, 0, 8, array.ndim]) + sizes + array.tobytes())


@pytest.fixture(scope="session")
def tiny_sets(tiny_data, tmp_path_factory):
    """A --data-dir holding every data set in its real format, a few images each: tiny_data's MNIST; random
    images as Fashion-MNIST's IDX files and as CIFAR-10's and CIFAR-100's pickled batches."""
    root = tmp_path_factory.mktemp("sets")
    (root / "MNIST").symlink_to(tiny_data / "MNIST")
    rng = np.random.default_rng(0)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split, count in (("train", 40), ("t10k", 12)):
        write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(raw / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, count, dtype=np.uint8))
    cifar10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for folder, files, key, classes in (
        ("cifar-10-batches-py", cifar10, b"labels", 10),
        ("cifar-100-python", ["train", "test"], b"fine_labels", 100),
    ):
        (root / folder).mkdir()
        for file in files:
            batch = {
                b"data": rng.integers(0, 256, (CIFAR_BATCH, 3 * 32 * 32), dtype=np.uint8),
                key: rng.integers(0, classes, CIFAR_BATCH).tolist(),
            }
            # the official files are Python 2 pickles; protocol 4 holds the same dictionary of bytes keys
            (root / folder / file).write_bytes(pickle.dumps(batch, protocol=4))
    return root


@pytest.fixture(scope="session")
def uninterrupted(tiny_data, tmp_path_factory):
    """uninterrupted(launch, script, *options): the folder of that run on tiny_data, trained to its end with no
    stop, kill or fault, by `python` or by `launch` ranks started by hand (helpers.launched()). Each is trained once
    in a pytest run, whichever worker asks first (the others wait for it), and shared: the tests that stop, kill or
    cut short the same run compare their resumed one against it, and only read it. The data's folder is a free
    option (not in the checkpoint): each worker's tiny_data holds the same images. What rank 0 printed is beside
    the folder, in <folder>.stdout."""

    def folder(launch, script, *options):
        key = "\0".join(map(str, (launch, script, *options)))
        out = shared(tmp_path_factory) / f"uninterrupted-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not Path(f"{out}.done").exists():  # none yet, or a worker's failed run left it unfinished
                shutil.rmtree(out, ignore_errors=True)
                args = stage_args(tiny_data, out, *options)
                run = python(script, *args) if launch == "python" else launched(launch, script, *args)
                assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
                Path(f"{out}.stdout").write_text(run.stdout)
                Path(f"{out}.done").touch()
        return out

    return folder


@pytest.fixture(scope="session")
def spawned(tiny_data, tmp_path_factory):
    """The folder of the results of the slow checks that start two ranks of their own (test_fsdp.py
    spawned_checks(): FSDP against DDP, the sharded initialisation, test_plan.py's bytes held at 2 ranks,
    test_equivalence.py's DDP options at 2 ranks): run in one pair of processes, a process group each, once per
    pytest run, whichever worker asks first (the others wait for it). Each process imports torch once, not once a
    check."""
    import test_fsdp  # the checks' own module, imported where they are asked for

    folder = shared(tmp_path_factory) / "spawned"
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"{folder}.done").exists():  # none yet, or a worker's failed run left it unfinished
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            test_fsdp.whole_weights(folder)
            ports = set()
            while len(ports) < 4:  # a port each: the checks' stores, one after another
                ports.add(free_port())
            spawn(test_fsdp.spawned_checks, (2, sorted(ports), tiny_data, folder), nprocs=2)
            Path(f"{folder}.done").touch()
    return folder


# The slow suite's longest tests (`pytest --durations`), started first: the two workers then end together,
# instead of one waiting out a long test that began last.
LONGEST = {
    "test_a_model_of_a_gigabyte_never_whole_on_a_rank",
    "test_hsdp_on_two_nodes_and_its_checkpoint_across_mesh_shapes",
    "test_resume_at_other_world_sizes_continues_the_same_run",
    "test_a_fresh_run_refuses_a_folder_with_any_stages_checkpoint",
    "test_compiled_and_eager_checkpoints_are_one_format",
    "test_a_task_of_another_job_on_this_port_is_named_and_the_job_it_met_is_untouched",
    "test_ten_torchrun_restarts_in_a_row_each_form_the_process_group",
    "test_each_bench_script_runs_on_the_cpu_at_its_smallest_size",
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in LONGEST)  # stable
