"""What the tests share, one helper for each thing a test does: start a stage (python, torchrun, srun's variables,
ranks by hand), find and signal a rank, wait for its files, read a checkpoint or the metrics; and a tiny MNIST in
the real file format."""

import csv
import gzip
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
INJECT = str(REPO / "tests" / "inject")  # its sitecustomize.py injects faults from outside the stages
TIMING = {"epoch_seconds", "images_per_s", "images_per_s_per_process"}  # the only fields a resume may change
STAGES = ["01_single_gpu", "02_dataparallel", "03_ddp_single_node", "04_ddp_multi_node", "05_fsdp"]
S01, S02, S03, S04, S05 = (REPO / stage / "train.py" for stage in STAGES)  # the stage scripts
# seconds a process may take before a test takes it for hung: far above any start-up on a busy machine (beside
# two other trainings on 2 cores, a 10 s run took over 60), below the default --dist-timeout (300 s), which a run
# that waits for a rank that never comes would wait out
HANG = 240
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


def shared(tmp_path_factory):
    """A folder that every test process of this pytest run shares: under pytest-xdist, its workers' common parent;
    otherwise this run's own temporary folder (the parent holds earlier runs' too)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_job_id():
    """A Slurm job id whose MASTER_PORT (environment.master_port: 20000 + id % 40000) is free now, so that two
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


def spawn(fn, args, nprocs):
    """mp.spawn(fn, args, nprocs=nprocs), each process ending as a run that succeeded ends (common/guards/ending.py):
    flushed, then os._exit(0), without the interpreter's teardown, where gloo's thread can abort a process that
    did its work (SIGABRT, "terminate called without an active exception": a rank of test_compile.py, once)."""
    mp.spawn(ended, args=(fn, *args), nprocs=nprocs)


def ended(rank, fn, *args):
    fn(rank, *args)  # an error: the traceback and status 1, which mp.spawn raises as it does
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def run(cmd, env=None, timeout=HANG, cwd=REPO):
    return subprocess.run(cmd, env=env or clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def torchrun_cmd(nproc, script, *args, restarts=0):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, f"--max-restarts={restarts}", str(script), *map(str, args)]


def torchrun(nproc, script, *args, env=None, timeout=HANG):
    return run(torchrun_cmd(nproc, script, *args), env=env, timeout=timeout)


def launched(nproc, script, *args, timeout=HANG, **env):
    """torchrun()'s result without torchrun's own process, which imports torch too (~4 CPU-s each), for the tests
    whose launcher is not what they check: `nproc` ranks started by hand (ranks()). stdout: rank 0's; stderr:
    every rank's; the status: the first failed rank's, else 0."""
    outs = finish(ranks(script, [args] * nproc, **env), timeout=timeout)
    status = next((out.returncode for out in outs if out.returncode), 0)
    return subprocess.CompletedProcess(script, status, outs[0].stdout, "".join(out.stderr for out in outs))


def srun_like(world_size, script, *args, job_id=None, nodelist="localhost", timeout=HANG, cwds=None, **env_extra):
    """Start `world_size` processes with the variables srun gives its tasks (one node, or one working
    folder per rank with `cwds`, as on nodes that share no filesystem); wait for all of them."""
    procs = srun_start(world_size, script, *args, job_id=job_id, nodelist=nodelist, cwds=cwds, **env_extra)
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outputs


def srun_start(world_size, script, *args, job_id=None, nodelist="localhost", cwds=None, **env_extra):
    """srun_like()'s processes, started and left running."""
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
    return procs


def start(script, *args, nproc=None, env=None):
    """A stage started and left running, by python or by torchrun with `nproc` ranks; its stdout and stderr in
    one stream, as in a job's log."""
    cmd = torchrun_cmd(nproc, script, *args) if nproc else [sys.executable, str(script), *map(str, args)]
    return subprocess.Popen(cmd, env=env or clean_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def nodes(script, *args, nproc=(1, 1), restarts=0, env=None):
    """torchrun agents meeting in a c10d rendezvous as on len(nproc) nodes, nproc[i] ranks on node i: started and
    left running. The store is not shared with the ranks, as in the job scripts, unless `env` says so."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nproc)}", f"--max-restarts={restarts}",
                "--rdzv_backend=c10d", "--rdzv_id=1", f"--rdzv_endpoint=127.0.0.1:{free_port()}"]  # fmt: skip
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} | (env or clean_env())
    cmds = [[*launcher, f"--nproc_per_node={n}", str(script), *map(str, args)] for n in nproc]
    return [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for cmd in cmds]  # fmt: skip


def ranks(script, args_per_rank, port=None, addr="127.0.0.1", **env):
    """One process per entry of `args_per_rank` (None: that rank is never started), with RANK, WORLD_SIZE and
    MASTER_ADDR set by hand, as a user would; stdout and stderr apart. finish() waits for them."""
    port = port or free_port()
    procs = []
    for rank, args in enumerate(args_per_rank):
        if args is not None:
            e = clean_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=len(args_per_rank), MASTER_ADDR=addr, MASTER_PORT=port,
                          **env)  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=e, cwd=REPO, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    return procs


def finish(procs, timeout=60):
    """Wait for `procs` (killing them all and raising TimeoutExpired where one outlives `timeout`): their
    CompletedProcess, each with .seconds, from this call to that process's own end (one thread each)."""
    start, outs = time.monotonic(), [None] * len(procs)

    def wait(i, p):
        stdout, stderr = p.communicate()
        outs[i] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        outs[i].seconds = time.monotonic() - start

    threads = [threading.Thread(target=wait, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for thread in threads:
        thread.start()
    for thread, p in zip(threads, procs, strict=True):
        thread.join(max(0, start + timeout - time.monotonic()))
        if thread.is_alive():
            for q in procs:
                q.kill()
            for t in threads:
                t.join()
            raise subprocess.TimeoutExpired(p.args, timeout)
    return outs


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


def rank_pid(marker, rank):
    """The PID of rank `rank` among the processes whose environment holds `marker`: a launcher's worker."""
    [pid] = [
        p
        for p in processes_with(marker)
        if f"RANK={rank}".encode() in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
    ]
    return pid


def one_error(out, *words):
    """Failed with exactly one `error:` line, naming all of `words`, and no traceback."""
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and len(errors) == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def assert_same_state(a, b, path="checkpoint"):
    """Field by field: model, optimizer, scheduler, epoch, RNG, the metrics (times excepted) and the record of what
    defines the run (not the id of the run that wrote it)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        whose = {"id"} if path == "checkpoint.run" else set()  # the run that wrote it (recorded.Stamp): 2 runs, 2 ids
        for key in a.keys() - TIMING - whose:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def wait_for(condition, timeout=60, proc=None):
    """Until `condition()` holds; failing at `timeout`, or at once if `proc` ended meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def wait_for_epoch(folder, epoch, proc=None, timeout=90):
    """Until metrics.csv in `folder` holds `epoch`'s row: that epoch is saved."""
    wait_for(lambda: len(metrics(folder)) >= epoch, timeout, proc)


# 2: a killed job loses its progress
def kill_rank_1_after_a_checkpoint(script, args, checkpoint):
    """torchrun with one restart; once `checkpoint` exists, SIGKILL rank 1: the run must restart and finish."""
    marker = f"TEST_RUN={uuid.uuid4()}"
    env = clean_env(TEST_RUN=marker.split("=")[1], TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)  # as the job scripts
    proc = subprocess.Popen(
        torchrun_cmd(2, script, *args, restarts=1), env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    wait_for(checkpoint.exists, proc=proc)
    os.kill(rank_pid(marker, 1), signal.SIGKILL)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "torchrun restart 1" in output, output


KILL_WAIT = 30  # Slurm's default KillWait: a stopped run that outlasts it, after its signal, is killed unsaved


def python(script, *args, timeout=HANG, **env):
    start = time.monotonic()
    out = run([sys.executable, str(script), *map(str, args)], env=clean_env(**env), timeout=timeout)
    out.seconds = time.monotonic() - start
    return out


def trained(uninterrupted, folder, script, *options):
    """In `folder`, a copy (links as links) of the run of `python script` with `options` on tiny_data, trained once
    per pytest run and shared (conftest.py `uninterrupted`): the test's own, to damage or continue, as if it had
    trained it there itself."""
    shutil.copytree(uninterrupted("python", script, *options), folder, symlinks=True, dirs_exist_ok=True)


def checkpoint(folder, name="checkpoint.pt"):
    """A file of tensors the run saved in `folder`: its checkpoint, or its model with name="model.pt"."""
    return torch.load(folder / name, weights_only=True)


def metrics(folder):
    """The rows of metrics.csv in `folder`, as dicts; none before the file exists."""
    path = folder / "metrics.csv"
    return list(csv.DictReader(open(path))) if path.exists() else []
