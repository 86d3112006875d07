"""What the job scripts share stays the same text everywhere, so that it never shows in the diffs
between stages (their lengths: test_budgets.py)."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HANG, REPO, clean_env

SCRIPTS = sorted(REPO.glob("0*/*.slurm"))
SWEEP = REPO / "sweeps/batch_size.slurm"


def block(path, first="# GPU use every 5 s", last="fi"):
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return lines[start : lines.index(last, start) + 1]


def test_gpu_log_block_is_the_same_in_every_job_script():
    blocks = {path.relative_to(REPO).as_posix(): block(path) for path in SCRIPTS}
    first = blocks["01_single_gpu/job.slurm"]
    assert len(blocks) == 6 and all(b == first for b in blocks.values()), blocks
    # the sweep names its GPU log as its log, after the array: %x-%A_%a
    sweep = [line.replace("${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID", "$SLURM_JOB_ID") for line in block(SWEEP)]
    assert sweep == first


def test_strict_mode_and_the_python_environment_are_the_same_everywhere():
    """Strict mode before the environment lines, so that a failure there stops the job where it happens."""
    blocks = [block(path, first="set -euo pipefail", last="fi") for path in [*SCRIPTS, SWEEP]]
    assert len(blocks) == 7 and all(b == blocks[0] for b in blocks) and "source" in blocks[0][5]


def test_without_python_and_torch_a_copied_job_script_names_the_line_to_edit(tmp_path):
    """Copied elsewhere, with no environment active and no .venv beside it: one line, at once."""
    copy = tmp_path / "elsewhere" / "01_single_gpu"
    copy.mkdir(parents=True)
    script = copy / "job.slurm"
    script.write_text((REPO / "01_single_gpu/job.slurm").read_text())
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # a python without torch
    (tmp_path / "bin" / "python").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(copy)}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=HANG)
    line = int(re.search(r"at line (\d+) of the job script", out.stderr)[1])
    assert out.returncode == 1 and out.stderr.count("error:") == 1 and not out.stdout, out
    assert "set yours up here" in script.read_text().splitlines()[line - 1]


def test_the_torchrun_job_script_derives_the_port_as_setup_does():
    """job_torchrun.slurm repeats common/environment.py's port formula in shell (it says so): the same ports."""
    from common.environment import master_port

    line = next(
        x
        for x in (REPO / "04_ddp_multi_node/job_torchrun.slurm").read_text().splitlines()
        if x.startswith("MASTER_PORT=")
    )
    for job_id in (1, 39_999, 40_000, 123_456_789):
        shell = subprocess.run(
            ["bash", "-c", f"SLURM_JOB_ID={job_id}; {line}; echo $MASTER_PORT"], capture_output=True, text=True
        )
        assert int(shell.stdout) == master_port(job_id)


@pytest.mark.slow
def test_a_job_whose_tasks_per_node_differ_from_its_gpus_stops_in_one_line():
    """The scripts that start a rank per task check the one rule a user must keep by hand."""
    import sys

    for script in ("04_ddp_multi_node/job.slurm", "05_fsdp/job.slurm"):
        folder = (REPO / script).parent
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(folder),
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
        out = subprocess.run(
            ["bash", str(REPO / script)], env=env, cwd=folder, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 1 and out.stderr == "error: --ntasks-per-node=2 but --gres=gpu:4: make them equal\n", (
            out
        )


@pytest.mark.parametrize(
    "script, unset, said",
    [
        *((path.relative_to(REPO).as_posix(), {"SLURM_CPUS_PER_TASK"}, ": SLURM_CPUS_PER_TASK: set --cpus-per-task")
          for path in SCRIPTS),
        ("03_ddp_single_node/job.slurm", {"SLURM_GPUS_ON_NODE"}, ": SLURM_GPUS_ON_NODE: set --gres=gpu:N"),
        ("04_ddp_multi_node/job_torchrun.slurm", {"SLURM_GPUS_ON_NODE"}, ": SLURM_GPUS_ON_NODE: set --gres=gpu:N"),
        ("04_ddp_multi_node/job.slurm", {"SLURM_NTASKS_PER_NODE"}, "error: --ntasks-per-node=? but --gres=gpu:2"),
        ("05_fsdp/job.slurm", {"SLURM_NTASKS_PER_NODE"}, "error: --ntasks-per-node=? but --gres=gpu:2"),
        ("05_fsdp/job.slurm", {"SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE"}, ": SLURM_NTASKS_PER_NODE: set --ntasks"),
    ],
)  # fmt: skip
def test_a_job_without_a_variable_its_sbatch_options_set_names_the_option(script, unset, said, tmp_path):
    """#SBATCH --cpus-per-task removed (or --cpus-per-gpu instead), no GPU asked for, --ntasks instead of
    --ntasks-per-node: bash's "unbound variable", naming no option to set. One line naming it."""
    folder = (REPO / script).parent
    env = {"PATH": fake_launch(tmp_path), "SLURM_SUBMIT_DIR": str(folder), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t",
           "SLURM_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1"}  # fmt: skip
    env = {k: v for k, v in env.items() if k not in unset}
    out = subprocess.run(["bash", str(REPO / script)], env=env, cwd=folder, capture_output=True, text=True,
                         timeout=HANG)  # fmt: skip
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out
    assert said in out.stderr and "unbound" not in out.stderr and not (tmp_path / "srun.args").exists(), out


@pytest.mark.parametrize("signal_name", ["TERM", "USR1"])
def test_a_signal_before_the_step_starts_ends_the_job_without_a_shell_error(signal_name, tmp_path):
    """A scancel, a preemption or the time limit's USR1 while the job's first commands run, before srun started the
    step: the traps waited for a step not yet set, and bash said "step: unbound variable", exit 1, no requeue. A
    TERM ends the job (143); a USR1 still requeues it."""
    path = fake_launch(tmp_path, "scancel")
    started = tmp_path / "started"
    flight = f'[ "$2" = common.guards.flightrecorder ] && touch {started} && sleep 2 && exit 0; '
    python = (tmp_path / "bin" / "python").read_text().replace("exit 0; exec", f"exit 0; {flight}exec")
    (tmp_path / "bin" / "python").write_text(python)
    (tmp_path / "bin" / "scontrol").write_text(f'#!/bin/sh\necho "$@" >>{tmp_path}/scontrol.args\n')
    folder = REPO / "01_single_gpu"
    env = {"PATH": path, "SLURM_SUBMIT_DIR": str(folder), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t",
           "SLURM_CPUS_PER_TASK": "4"}  # fmt: skip
    job = subprocess.Popen(["bash", str(folder / "job.slurm")], env=env, cwd=folder, stderr=subprocess.PIPE, text=True)
    while not started.exists() and job.poll() is None:
        time.sleep(0.05)
    job.send_signal(getattr(signal, f"SIG{signal_name}"))
    stderr = job.communicate(timeout=HANG)[1]
    assert "unbound" not in stderr, stderr
    if signal_name == "TERM":
        assert job.returncode == 143 and not (tmp_path / "srun.args").exists(), (job.returncode, stderr)
    else:
        assert "requeue 4242" in (tmp_path / "scontrol.args").read_text(), stderr


@pytest.mark.parametrize("given", [["--batch-size", "128"], ["--epochs", "1", "--batch-size=128"], ["--output", "x"]])
def test_the_sweep_refuses_the_options_it_sets_itself(given, tmp_path):
    """--batch-size 128 given to the sweep came after its own --batch-size 32 and won: runs/.../bs32 trained at 128,
    and the plot put it at 32, unsaid. One line, before any step; other options pass through."""
    env = {"PATH": fake_launch(tmp_path), "SLURM_SUBMIT_DIR": str(SWEEP.parent), "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t",
           "SLURM_CPUS_PER_TASK": "4", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "0"}  # fmt: skip
    out = subprocess.run(["bash", str(SWEEP), *given], env=env, cwd=SWEEP.parent, capture_output=True, text=True,
                         timeout=HANG)  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith(f"error: {given[-2] if '=' not in given[-1] else given[-1]}")
    assert (
        out.stderr.count("\n") == 1
        and "the sweep sets it (bs32" in out.stderr
        and not (tmp_path / "srun.args").exists()
    )
    ran = subprocess.run(["bash", str(SWEEP), "--epochs", "1"], env=env, cwd=SWEEP.parent, capture_output=True,
                         text=True, timeout=HANG)  # fmt: skip
    assert ran.returncode == 0 and "--batch-size\n32\n" in (tmp_path / "srun.args").read_text(), ran


def fake_launch(tmp_path, *tools, numa=None):
    """A PATH where `srun` records its arguments and environment and exits 0, `scontrol` names one node, `python -c
    "import torch"` succeeds at once (any other python is this one) and each of `tools` (numactl, nvidia-smi)
    exists and does nothing: a job script runs to its srun line without Slurm. `numa`: what `python -m
    common.guards.numa` prints instead (the binding decided on GPUs this machine lacks)."""
    import sys

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    numa = "" if numa is None else f'[ "$2" = common.guards.numa ] && echo "{numa}" && exit 0; '
    scripts = {
        "srun": f'printf "%s\\n" "$@" >{tmp_path}/srun.args; env >{tmp_path}/srun.env',
        "scontrol": "echo node1",
        "python": f'[ "$1" = -c ] && [ "$2" = "import torch" ] && exit 0; {numa}exec {sys.executable} "$@"',
    } | {tool: "exit 0" for tool in tools}
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    return f"{bin_}:/usr/bin:/bin"


def launch(script, tmp_path, path, *args, **exported):
    """Run a job script as sbatch would, in its folder: (srun's arguments, srun's environment)."""
    folder = (REPO / script).parent
    env = {"PATH": path, "SLURM_SUBMIT_DIR": str(folder), "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t",
           "SLURM_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"} | exported  # fmt: skip
    out = subprocess.run(["bash", str(REPO / script), *map(str, args)], env=env, cwd=folder, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and not out.stderr, out
    lines = (tmp_path / "srun.env").read_text().splitlines()
    return (tmp_path / "srun.args").read_text().splitlines(), dict(line.split("=", 1) for line in lines if "=" in line)


def test_every_job_script_switches_on_the_flight_recorder_into_the_runs_folder(tmp_path):
    """NCCL's flight recorder, old and new names, dumping into the folder the ranks write: --output-dir, relative to
    the submit folder, or the stage's default for the job's first step; the ranks srun starts bound to their cores."""
    from common import cli
    from common.guards import flightrecorder

    path = fake_launch(tmp_path)
    for script in SCRIPTS:
        name = script.relative_to(REPO).as_posix()
        given = name.startswith("04_ddp_multi_node/job.")  # one script on the default folder: the others given one
        args, env = launch(name, tmp_path, path, "--epochs", 1, *([] if given else ["--output-dir", "out dir"]))
        folder = script.parent / "out dir"
        if given:  # what train.py finds itself in srun's first step
            folder = cli.default_output_dir(script.parent / "train.py", {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"})
        expected = flightrecorder.variables(f"{folder}/flight-recorder-rank-")
        assert {k: env.get(k) for k in expected} == expected, name
        srun_starts_ranks = "torchrun" not in args and script.parent.name in ("04_ddp_multi_node", "05_fsdp")
        assert ("--cpu-bind=cores" in args) == srun_starts_ranks, (name, args)
        assert not [a for a in args if a.startswith("--numa-binding")], (name, args)  # no numactl, no GPU here


def test_the_torchrun_scripts_keep_an_exported_rendezvous_and_a_thread_per_rank(tmp_path):
    """MASTER_ADDR and MASTER_PORT exported (the README's fix for a port in use) were replaced by the first node and
    the job's port; --cpus-per-task=1 for 2 GPUs exported OMP_NUM_THREADS=0, which libgomp refuses (torch then
    took every core)."""
    path, torchrun = fake_launch(tmp_path), "04_ddp_multi_node/job_torchrun.slurm"
    args, env = launch(torchrun, tmp_path, path, MASTER_ADDR="node1-ib", MASTER_PORT="31337", SLURM_CPUS_PER_TASK="1")
    assert "--rdzv_endpoint=node1-ib:31337" in args and env["OMP_NUM_THREADS"] == "1", (args, env)
    args, env = launch(torchrun, tmp_path, path)  # none exported: the first node, the job's port
    assert "--rdzv_endpoint=node1:24242" in args and env["OMP_NUM_THREADS"] == "2", (args, env)
    assert launch("03_ddp_single_node/job.slurm", tmp_path, path, SLURM_CPUS_PER_TASK="1")[1]["OMP_NUM_THREADS"] == "1"


def test_a_torchrun_script_submitted_from_another_folder_is_one_line(tmp_path):
    """`sbatch 03_ddp_single_node/job.slurm` from the repository: its check passed, then torchrun ran a train.py that
    is not there, twice (--max-restarts), and ended in a ChildFailedError traceback."""
    for script in ("03_ddp_single_node/job.slurm", "04_ddp_multi_node/job_torchrun.slurm"):
        (tmp_path / script).parent.mkdir()
        env = {"PATH": fake_launch((tmp_path / script).parent), "SLURM_SUBMIT_DIR": str(REPO),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t", "SLURM_CPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "2",
               "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1"}  # fmt: skip
        out = subprocess.run(
            ["bash", str(REPO / script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=HANG
        )
        said = f"error: no train.py in {REPO}: submit the job from its stage's folder (cd it; sbatch ...)\n"
        assert out.returncode == 1 and out.stderr == said, out


def test_the_flight_recorder_leaves_a_usage_error_to_train_py(tmp_path):
    """`--output-dir` without its value: the recorder's export goes to the default folder, silently, so that the
    job's log holds the usage error once, from the ranks, not a second time from the job script."""
    out = subprocess.run([sys.executable, "-m", "common.guards.flightrecorder", "--epochs", "1", "--output-dir"],
                         cwd=REPO / "04_ddp_multi_node", env=clean_env(SLURM_JOB_ID="7"), capture_output=True,
                         text=True, timeout=HANG)  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", out
    assert "runs/04_ddp_multi_node/7.0/flight-recorder-rank-" in out.stdout, out.stdout


def test_the_flight_recorders_names_are_those_the_installed_torch_reads():
    """torch 2.9 reads TORCH_FR_ (and warns of TORCH_NCCL_TRACE_BUFFER_SIZE in every rank's log); 2.7 reads only the
    TORCH_NCCL_ names: each gets its own, into the same place, and no name it would warn of."""
    from common.guards import flightrecorder

    new, old = (flightrecorder.variables("/run/fr-", version) for version in ("2.9.0", "2.7.1+cu126"))
    assert new["TORCH_FR_DUMP_TEMP_FILE"] == old["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/run/fr-"
    assert new["TORCH_FR_BUFFER_SIZE"] == old["TORCH_NCCL_TRACE_BUFFER_SIZE"] != "0"
    assert not any(name.startswith("TORCH_FR_") for name in old)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in new and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in new


@pytest.mark.slow
@pytest.mark.parametrize("numa", ["--numa-binding=node", ""])
def test_torchrun_binds_ranks_to_their_gpus_numa_node_where_it_can(numa, tmp_path):
    """torchrun gets --numa-binding=node where common.guards.numa finds every rank's CPUs meet its GPU's node, else
    no flag (given numactl and GPUs, the scripts once added it where torch stops the run: no CPU to bind to)."""
    path = fake_launch(tmp_path, "numactl", "nvidia-smi", numa=numa)
    for script in ("03_ddp_single_node/job.slurm", "04_ddp_multi_node/job_torchrun.slurm"):
        args, _ = launch(script, tmp_path, path, "--epochs", 1, "--output-dir", tmp_path / "out")
        assert (args[args.index("torchrun") + 1] == "--numa-binding=node") == bool(numa), args


def two_sockets(root):
    """A two-socket node as sysfs gives it: NUMA node 0 holds CPUs 0-7, node 1 CPUs 8-15; GPU 0 (0000:3b:00.0) sits
    on node 0, GPU 1 (0000:af:00.0) on node 1."""
    for node, cpus in ((0, "0-7\n"), (1, "8-15\n")):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus)
    for bus, node in (("0000:3b:00.0", 0), ("0000:af:00.0", 1)):
        (root / "bus/pci/devices" / bus).mkdir(parents=True)
        (root / "bus/pci/devices" / bus / "numa_node").write_text(f"{node}\n")
    return root


def test_numa_binding_only_where_each_ranks_cpus_meet_its_gpus_node(tmp_path, capsys):
    """1 task, 8 CPUs, --gres=gpu:2 on a two-socket node: Slurm gave CPUs 0-7 (socket 0) and both GPUs, and
    torchrun --numa-binding=node stops the run at start ('Must bind to a non-empty set of CPU indices') binding
    local rank 1 to node 1's CPUs. The job script then runs the ranks unbound, saying so once; CPUs on both
    sockets bind; a GPU whose node sysfs does not give runs unbound; no GPU or numactl: no flag, nothing said."""
    from common.guards import numa

    root, gpus = two_sockets(tmp_path / "sys"), ["0000:3b:00.0", "0000:AF:00.0"]
    assert numa.flag(gpus, set(range(8)), root) == ""
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith("NUMA: the ranks run unbound: local rank 1's GPU (0000:AF:00.0)")
    assert "NUMA node 1 (CPUs 8-15), where the job may use none of its CPUs (0-7)" in said, said
    assert numa.flag(gpus, {0, 1, 2, 3, 8, 9, 10, 11}, root) == numa.FLAG  # 2 tasks' worth, one on each socket
    assert numa.flag(gpus[:1], set(range(8)), root) == numa.FLAG  # one GPU, beside the job's CPUs
    assert (
        numa.flag(["0000:00:01.0"], set(range(8)), root) == "" and "sysfs gives no NUMA node" in capsys.readouterr().err
    )
    (root / "bus/pci/devices/0000:3b:00.0/numa_node").write_text("-1\n")  # one node, or not said: torch takes node 0
    assert numa.flag(gpus[:1], set(range(8)), root) == numa.FLAG
    assert numa.flag([], set(range(8)), root) == "" and not capsys.readouterr().err
