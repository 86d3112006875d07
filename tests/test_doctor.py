"""tools/doctor.py on this machine: `make doctor` passes, and faults on one rank are FAIL lines naming
that rank, in seconds. Real processes with gloo; the Slurm cases are in tests/slurm/test_doctor_job.py."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import HANG, REPO, clean_env, free_port, one_error, srun_like

from common import cli
from common.guards import launching, preflight

DOCTOR = REPO / "tools" / "doctor.py"
CHECKS = ["ranks", "ranks per node", "GPU per rank", "NUMA", "CPUs per rank", "python version", "torch version",
          "CUDA version", "NCCL version", "project version", "torch minimum", "MASTER_ADDR", "interface", "transport",
          "all-reduce", "busbw within nodes", "stragglers", "data", "output folder", "Slurm CPUs, GPUs"]  # fmt: skip
MORE = ["busbw across nodes", "requeue"]  # on several nodes; in a Slurm job


def table(output):
    """{check: (status, the rest of the line)} of the verdict table."""
    rows = [line.split(None, 1) for line in output.splitlines() if line[:4] in ("PASS", "WARN", "FAIL")]
    found = {}
    for status, rest in rows:
        check = next(c for c in sorted(CHECKS + MORE, key=len, reverse=True) if rest.startswith(c))
        found[check] = (status, rest[len(check) :].strip())
    return found


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_doctor_passes_on_this_machine(tmp_path):
    """Its report replaces a link named doctor.json, never writing through it (a user's file was overwritten). The GPUs
    hidden (CUDA_VISIBLE_DEVICES=-1) are none: they were counted as one, and two ranks failed "ranks per node"."""
    (tmp_path / "doctor.json").symlink_to(tmp_path.parent / f"{tmp_path.name}-victim.txt")
    (tmp_path.parent / f"{tmp_path.name}-victim.txt").write_text("the user's")
    out = subprocess.run(["make", "--no-print-directory", "doctor", f"ARGS=--output-dir {tmp_path}"], cwd=REPO,
                         env=clean_env(CUDA_VISIBLE_DEVICES="-1"), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table(out.stdout)
    assert list(rows) == CHECKS and not [r for r in rows.values() if r[0] == "FAIL"], out.stdout
    assert "2 arrived" in rows["ranks"][1] and "exact in float32, bfloat16, float16, int64" in rows["all-reduce"][1]
    assert (tmp_path.parent / f"{tmp_path.name}-victim.txt").read_text() == "the user's"
    assert f"report: {tmp_path / 'doctor.json'} (tools/plan.py --doctor" in out.stdout  # where: runs/doctor/<id>
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert [c["check"] for c in report["checks"]] == CHECKS and [r["rank"] for r in report["ranks"]] == [0, 1]
    assert "Traceback" not in out.stderr and not list(tmp_path.glob(".doctor-*"))  # the ranks' files are gone


def test_faults_on_one_rank_are_fail_lines_naming_it(tiny_data, tmp_path):
    """Two srun-style ranks, each in its own working folder as on nodes that share no filesystem, with the
    relative --data-dir data and --output-dir out. Both are given the same GPU (CUDA_VISIBLE_DEVICES=0, the
    identity the doctor reads where torch sees no GPU); rank 1 sees a data set without one file, finds a
    file where its output folder should be, and, through tests/inject, reports another torch and computes
    thirty times slower (ten times, on two cores shared with other work, once came out under the FAIL line's 3x).
    Each fault is its own FAIL line naming rank 1 (both ranks for the shared GPU); the checks around them pass."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(tiny_data, nodes[0] / "data")
    shutil.copytree(tiny_data, nodes[1] / "data")
    (nodes[1] / "data/MNIST/raw/t10k-labels-idx1-ubyte").unlink()
    (nodes[1] / "out").touch()
    codes, (rank0, rank1) = srun_like(  # no clock: a hang ends in --dist-timeout's error line, refused below
        2, DOCTOR, "--data-dir", "data", "--output-dir", "out", "--dist-timeout", 60, cwds=nodes, timeout=180,
        CUDA_VISIBLE_DEVICES="0", PYTHONPATH=f"{REPO / 'tests/inject'}:{REPO}", FAULT_RANK=1, FAULT_SLOW=30,
        FAULT_TORCH="2.0.0",
    )  # fmt: skip
    assert codes == [1, 1], rank0 + rank1
    assert "Traceback" not in rank0 + rank1 and "error:" not in rank0 + rank1 and not rank1.strip()
    rows = table(rank0)
    failed = {check: rest for check, (status, rest) in rows.items() if status == "FAIL"}
    assert "rank 0 (" in failed["GPU per rank"] and "rank 1 (" in failed["GPU per rank"], rank0
    assert "rank 1 (" in failed["torch version"] and ": 2.0.0, the others" in failed["torch version"]
    assert failed["torch minimum"].startswith("rank 1 (") and "2.0.0, where 01_single_gpu needs ≥ 2.3" in rank0
    assert failed["data"].startswith("rank 1 (") and "cannot load it" in failed["data"], failed["data"]
    assert "(missing t10k-labels-idx1-ubyte)" in failed["data"] and "rank 0" not in failed["data"]
    assert (
        failed["output folder"].startswith("rank 1 (")
        and "out is a file, or inside one, not a folder" in failed["output folder"]
    )  # it said "cannot write out/.doctor-... (Not a directory)"
    assert failed["stragglers"].startswith("rank 1 (")
    assert set(failed) == {"ranks per node", "GPU per rank", "torch version", "torch minimum", "data", "output folder",
                           "stragglers"}  # fmt: skip
    assert json.loads((nodes[0] / "out/doctor.json").read_text())["checks"][0]["status"] == "PASS"


VECTORS = """# A task of its own: vectors of 12 numbers in 3 classes, saved in --data-dir/vectors.pt
import torch
from torch import nn


def model(args):
    return nn.Linear(12, 3)


def datasets(args):
    vectors, labels = torch.load(args.data_dir / "vectors.pt")
    return torch.utils.data.TensorDataset(vectors[:32], labels[:32]), torch.utils.data.TensorDataset(vectors[32:], labels[32:])
"""


def test_the_lessons_refusal_is_reported_as_its_message_and_a_tasks_error_with_its_type(tmp_path):
    """A rank that cannot load the data: the lesson's refusal (a set not in --data-dir) reads as its
    message, which names the fix; a task's own error keeps its type."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    training = SimpleNamespace(data_dir=tmp_path, dataset="mnist", limit=None)
    facts = doctor.data_facts(cli.load_task(cli.TASK), training)
    assert facts["fingerprints"] is None and facts["error"].startswith(f"mnist is not in {tmp_path / 'MNIST'}")
    mine = SimpleNamespace(datasets=lambda args: int("x"))
    assert doctor.data_facts(mine, training)["error"].startswith("ValueError: invalid literal")


def test_the_data_row_checks_the_files_as_a_stage_does_and_bandwidth_is_the_slowest_nodes(tmp_path):
    """A labels file of the test set's 10,000 in the training set's place, or a label 42: the doctor said PASS
    (`10000-...` alike on every rank), which the stage then refused. busbw within nodes was rank 0's node alone:
    a node half as fast, or one where rank 0's node had a single rank, was never seen."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    raw = tmp_path / "MNIST" / "raw"
    shutil.copytree(REPO / "data" / "MNIST" / "raw", raw, ignore=shutil.ignore_patterns("*.gz"))
    shutil.copy(raw / "t10k-labels-idx1-ubyte", raw / "train-labels-idx1-ubyte")
    training = SimpleNamespace(data_dir=tmp_path, dataset="mnist", limit=None)
    facts = doctor.data_facts(cli.load_task(cli.TASK), training)
    assert facts["fingerprints"] is None and "train-labels-idx1-ubyte: 10000 labels for 60000 images" in facts["error"]
    sweep = lambda busbw: [[2**20, busbw / 2, busbw / 2], [2**28, busbw, busbw]]  # noqa: E731
    ranks = [{"rank": 0, "host": "a", "bandwidth": {"within nodes": sweep(40.0)}},
             {"rank": 2, "host": "b", "bandwidth": {"within nodes": sweep(3.0)}}]  # fmt: skip
    [(check, status, detail, fix)] = doctor.check_bandwidth(SimpleNamespace(everyone=ranks, gpu=True))
    assert (check, status) == ("busbw within nodes", "WARN") and "busbw 3 GB/s" in detail and "rank 2 (b)" in detail
    ranks[0]["bandwidth"] = {}  # rank 0 alone on its node: no within-node figure of its own
    [(_, status, detail, _)] = doctor.check_bandwidth(SimpleNamespace(everyone=ranks, gpu=True))
    assert status == "WARN" and "busbw 3 GB/s" in detail


def test_a_probe_a_doctor_that_died_left_is_no_ranks_of_this_one(tmp_path):
    """Each node's own --output-dir (node-local scratch) holding the probes of a doctor that died before removing
    them (`.doctor-1` beside rank 0): "shared by every node", PASS, for a folder no other node sees."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    (tmp_path / ".doctor-1").touch()  # the probes of an earlier doctor, as it named them
    (tmp_path / ".doctor-0a1b2c3d-1").touch()  # and as this one names them: another run's token
    args, nothing = SimpleNamespace(output_dir=tmp_path), SimpleNamespace(datasets=lambda args: [])
    facts = doctor.file_facts(args, nothing, None, rank=0, world_size=2)  # rank 1 on a node of its own
    assert facts["sees"] == [0] and Path(facts["probe"]).exists()


def test_a_gpu_per_task_binding_is_a_rank_per_gpu():
    """Each task sees its own GPU alone (--gpus-per-task=1): one GPU a rank saw, two ranks a node, FAIL, and the fix
    asked for what the job already did; two ranks that see one and the same GPU still FAIL."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    def row(*gpus):
        ranks = [{"rank": r, "host": "a", "gpus": 1, "gpu": f"CUDA_VISIBLE_DEVICES {g}"} for r, g in enumerate(gpus)]
        [(_, status, detail, _)] = doctor.check_ranks_per_node(SimpleNamespace(hosts={"a": ranks}, everyone=ranks))
        return status, detail

    assert row(0, 1) == ("PASS", "one per GPU")
    assert row(0, 0) == ("FAIL", "a: 2 ranks, 1 GPUs")


def test_a_slurm_count_that_is_no_number_is_a_warn_line_not_an_error():
    """SLURM_GPUS_ON_NODE=2x (set by hand, or by a wrapper) ended the doctor in a ValueError line that advised --resume,
    which it has not; SLURM_CPUS_PER_TASK=abc was named. Each is its row's WARN now, the other facts still checked."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    slurm = {"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "4", "SRUN_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "2x"}
    rank = {"rank": 0, "host": "a", "cpus": 2, "gpus": 0, "slurm": slurm}
    [(_, status, detail, _)] = doctor.check_slurm_resources(SimpleNamespace(everyone=[rank]))
    assert (
        status == "WARN"
        and detail == "rank 0 (a): SLURM_GPUS_ON_NODE='2x' is not a count; rank 0 (a): 2 CPUs of --cpus-per-task=4"
    )


@pytest.mark.parametrize("value, ids", [("-1", []), ("NoDevFiles", []), ("", []), ("0,2", ["0", "2"]),
                                       ("1,-1,2", ["1"]), ("GPU-5e1a,MIG-7", ["GPU-5e1a", "MIG-7"])])  # fmt: skip
def test_gpus_hidden_by_cuda_visible_devices_are_none(value, ids):
    """CUDA_VISIBLE_DEVICES=-1 (or NoDevFiles) hides every GPU: the doctor counted it as one, and two ranks on the node
    failed "ranks per node: 2 ranks, 1 GPUs" and "GPU per rank: all use -1"."""
    sys.path.insert(0, str(DOCTOR.parent))
    import doctor

    assert doctor.visible({"CUDA_VISIBLE_DEVICES": value}) == ids


@pytest.mark.parametrize("theirs", [pytest.param("the same", marks=pytest.mark.slow), "other"])
def test_another_tasks_data_is_compared_across_ranks(tmp_path, theirs):
    """--task: two srun-style ranks, each in its own working folder, load the task's own data (no MNIST
    anywhere). The same vectors pass, the line naming the fingerprints of its training and test sets; other
    vectors on rank 1 are a FAIL line naming rank 1."""
    task = tmp_path / "vectors.py"
    task.write_text(VECTORS)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node, seed in zip(nodes, (0, 0 if theirs == "the same" else 1), strict=True):
        (node / "data").mkdir(parents=True)
        generator = torch.Generator().manual_seed(seed)
        vectors = (torch.randn(40, 12, generator=generator), torch.randint(3, (40,), generator=generator))
        torch.save(vectors, node / "data/vectors.pt")
    codes, (rank0, rank1) = srun_like(2, DOCTOR, "--task", task, "--data-dir", "data", "--output-dir", "out",
                                      "--dist-timeout", 10, cwds=nodes, timeout=HANG)  # fmt: skip
    assert "Traceback" not in rank0 + rank1 and not rank1.strip(), rank0 + rank1
    status, detail = table(rank0)["data"]
    if theirs == "the same":
        sets = cli.load_task(task).datasets(SimpleNamespace(data_dir=nodes[0] / "data"))
        assert status == "PASS" and " / ".join(map(preflight.fingerprint, sets)) in detail, rank0
        assert codes == [0, 0], rank0
    else:
        assert status == "FAIL" and detail.startswith("rank 1 (") and "rank 0" not in detail, rank0
        assert codes == [1, 1], rank0


@pytest.mark.slow
def test_a_rank_that_never_starts_is_the_rendezvous_error(tmp_path):
    env = clean_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(DOCTOR), "--output-dir", str(tmp_path), "--dist-timeout", "3"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    out.seconds = time.monotonic() - start
    one_error(out, "ranks 1 of 2 did not arrive", "within --dist-timeout 3 s", "srun")
    assert out.seconds < 3 + 12


@pytest.mark.parametrize("backend, value, ok", [("gloo", "lo", True), ("gloo", "lo,nope0", False), ("nccl", "l", True),
                                                ("nccl", "=l", False), ("nccl", "^lo", True), ("nccl", "nope", False)])  # fmt: skip
def test_a_socket_interface_the_host_lacks_is_named(monkeypatch, backend, value, ok):
    """setup() checks the interface variable of its backend against this host's interfaces: NCCL's
    prefixes, "=" exact names and "^" exclusions; gloo's exact names, each of which must exist."""
    monkeypatch.setenv(f"{backend.upper()}_SOCKET_IFNAME", value)
    if ok:
        launching.check_interfaces(backend)
    else:
        with pytest.raises(SystemExit, match=r"^error: .*_SOCKET_IFNAME=.* has no interface .*\(it has .*lo"):
            launching.check_interfaces(backend)


def sysfs(root, gpu_node):
    """A machine of two NUMA nodes (CPUs 0-3, 4-7) whose GPU at 0000:3b:00.0 sits on `gpu_node`."""
    for node, cpus in ((0, "0-3\n"), (1, "4-5,6-7\n")):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus)
    (root / "bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (root / "bus/pci/devices/0000:3b:00.0/numa_node").write_text(f"{gpu_node}\n")
    return root


def test_the_numa_line_names_a_rank_whose_cpus_are_off_its_gpus_node(tmp_path):
    """The doctor reads the GPU's NUMA node and that node's CPUs from sysfs (here a fake one) against the rank's
    affinity: on the node, PASS; CPUs spanning both nodes (an unbound rank), WARN naming the rank and the CPUs off
    it; a machine that does not say (-1), nothing to judge; no GPU, skipped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doctor", DOCTOR)
    doctor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doctor)
    root = sysfs(tmp_path / "sys", gpu_node=1)
    assert doctor.beside_gpu({4, 5}, "0000:3B:00.0", root) == (1, [])
    assert doctor.beside_gpu(set(range(8)), "0000:3b:00.0", root) == (1, [0, 1, 2, 3])
    assert doctor.numa_nodes({3, 4}, root) == [0, 1]
    assert doctor.beside_gpu({0}, "0000:3b:00.0", sysfs(tmp_path / "one", gpu_node=-1)) is None
    assert doctor.beside_gpu({0}, "0000:3b:00.0", tmp_path / "none") is None

    def line(gpu, *beside):
        ranks = [{"rank": r, "host": "n1", "cpus": 8, "beside_gpu": b} for r, b in enumerate(beside)]
        [row] = doctor.check_numa(SimpleNamespace(everyone=ranks, gpu=gpu))
        return row[:3]

    near, far = doctor.beside_gpu({4, 5}, "0000:3b:00.0", root), doctor.beside_gpu(set(range(8)), "0000:3b:00.0", root)
    assert line(True, near, near) == (
        "NUMA",
        "PASS",
        "each rank's CPUs on its GPU's NUMA node (2 of 2 ranks' nodes known)",
    )
    _, status, detail = line(True, near, far)
    assert status == "WARN" and detail == "rank 1 (n1): 4 of its 8 CPUs off NUMA node 1, its GPU's (0-3)", detail
    assert line(True, None, None)[1:] == ("PASS", "unknown: sysfs gives no GPU's NUMA node (one node, or not said)")
    socket0 = {"rank": 1, "host": "n1", "cpus": 4, "beside_gpu": doctor.beside_gpu({0, 1, 2, 3}, "0000:3b:00.0", root)}
    [(_, status, detail, *_)] = doctor.check_numa(SimpleNamespace(everyone=[socket0], gpu=True))  # none on its node
    assert status == "WARN" and detail.startswith("rank 1 (n1): 4 of its 4 CPUs off NUMA node 1"), detail
    assert "none on it, so torchrun --numa-binding=node cannot bind it (the job scripts run unbound" in detail, detail
    assert line(False, None, None)[1:] == ("PASS", "skipped: no GPU")
