"""What the tests share: the stage scripts as real processes, and a tiny MNIST in the real file format."""

import gzip
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = ["01_single_gpu", "02_dataparallel", "03_ddp_single_node", "04_ddp_multi_node", "05_fsdp"]
TRAIN_SIZE, TEST_SIZE = 256, 10  # 10 test images: not a multiple of 3, for the exact-once test


def write_idx_subset(src, dst, count):
    """The first `count` records of a real IDX file, with its header rewritten for that count."""
    raw = gzip.open(src).read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    record = 1
    for d in shape[1:]:
        record *= d
    header = raw[:4] + count.to_bytes(4, "big") + raw[8 : 4 + 4 * dims]
    dst.write_bytes(header + raw[4 + 4 * dims : 4 + 4 * dims + count * record])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_job_id():
    """A Slurm job id whose MASTER_PORT (distributed.master_port: 20000 + id % 40000) is free now, so that two
    srun-style runs at once, of this suite or of another, do not meet on one port."""
    port = free_port()
    while not 20000 <= port < 60000:
        port = free_port()
    return port - 20000


def clean_env(**extra):
    """The environment of a process the tests start: no launcher or Slurm variables of our own, one
    thread per process (two cores), `common` importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def stage_args(data_dir, output_dir, *extra):
    return ["--data-dir", str(data_dir), "--output-dir", str(output_dir), "--num-workers", "0", *map(str, extra)]


def run(cmd, env=None, timeout=120, cwd=REPO):
    return subprocess.run(cmd, env=env or clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def torchrun_cmd(nproc, script, *args, restarts=0):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, f"--max-restarts={restarts}", str(script), *map(str, args)]


def torchrun(nproc, script, *args, env=None, timeout=120):
    return run(torchrun_cmd(nproc, script, *args), env=env, timeout=timeout)


def srun_like(world_size, script, *args, job_id=None, nodelist="localhost", timeout=120, cwds=None, **env_extra):
    """Start `world_size` processes with the variables srun gives its tasks (one node, or one working
    folder per rank with `cwds`, as on nodes that share no filesystem); wait for all of them."""
    job_id = job_id or free_job_id()
    procs = []
    for rank in range(world_size):
        env = clean_env(
            SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST=nodelist, SLURM_NTASKS=world_size, SLURM_PROCID=rank,
            SLURM_LOCALID=rank, SLURM_STEP_ID=0, SLURM_NTASKS_PER_NODE=f"{world_size}", **env_extra,
        )  # fmt: skip
        cmd = [sys.executable, str(script), *map(str, args)]
        cwd = cwds[rank] if cwds else REPO
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outputs


def processes_with(marker):
    """PIDs of the live processes whose environment holds `marker` (NAME=value): what a run left behind."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def one_error(out, *words):
    """Failed with exactly one `error:` line, naming all of `words`, and no traceback."""
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]
