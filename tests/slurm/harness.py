# SPDX-License-Identifier: BSD-3-Clause
"""Drive the local test cluster of cluster.sh from Python (standard library only).

Typical use: `ok, reason = available()`, `start()`, `job_id = submit(script, sbatch_opts=[...])`,
`info = wait(job_id)` giving e.g. info["JobState"] == "COMPLETED", info["ExitCode"] == "0:0",
info["StdOut"] (the output file, %j expanded), and at the end `stop()`.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import time
from pathlib import Path

CLUSTER_SH = Path(__file__).with_name("cluster.sh")
DIR = Path(os.environ.get("SLURM_TEST_DIR", "/tmp/slurm-test"))  # cluster.sh's
SCRATCH = DIR / "scratch"  # in netns mode, each node's own folder here is DIR/nodes/<node>

# Everything else (COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...) is final.
NOT_FINISHED = set(
    "PENDING CONFIGURING RUNNING COMPLETING SUSPENDED RESIZING SIGNALING STAGE_OUT"
    " REQUEUED REQUEUE_HOLD REQUEUE_FED".split()
)


def _cluster(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SH), command], capture_output=True, text=True)


def _check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{tail}")


@functools.cache
def available() -> tuple[bool, str]:
    """(True, "") if the cluster can be started here, else (False, one-line reason).

    May install the Slurm packages with apt-get (once per process) when they are missing.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not root: the Slurm tests need root (make test-slurm)"
    result = _cluster("install")
    if result.returncode:
        lines = (result.stdout + result.stderr).strip().splitlines() or ["no output"]
        return False, f"cannot install Slurm: {lines[-1]}"
    return True, ""


def start() -> None:
    """Start the cluster (a no-op if it is already up); raises RuntimeError with the log tail."""
    _check(_cluster("start"), "cluster.sh start")


def mode() -> str:
    """netns (a network, a hostname and a node-local SCRATCH per node) or loopback (both on 127.0.0.1)."""
    return (DIR / "run" / "mode").read_text().strip()


def stop() -> None:
    """Stop the cluster: cancels its jobs and ends every process it started."""
    _check(_cluster("stop"), "cluster.sh stop")


def submit(script, *args, sbatch_opts=(), env=None, cwd=None) -> str:
    """`sbatch --parsable` the script with its arguments; returns the job id.

    env holds variables added to this process's environment (sbatch passes it on to the job).
    cwd, the job's working and submit directory, defaults to the script's folder.
    """
    script = Path(script).resolve()
    command = ["sbatch", "--parsable", *sbatch_opts, str(script), *map(str, args)]
    result = subprocess.run(
        command, cwd=cwd or script.parent, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    _check(result, " ".join(command))
    return result.stdout.strip().split(";")[0]  # "id" or "id;cluster"


def job_info(job_id) -> dict[str, str]:
    """The fields of `scontrol show job -o`, e.g. JobState, ExitCode, StdOut, RestartCnt, NodeList."""
    result = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    _check(result, f"scontrol show job {job_id}")
    line = result.stdout.splitlines()[0]
    # A value runs up to the next " Key=" (values may hold spaces, and "=" as in TRES=cpu=4,node=2).
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w/:]*)=", line))
    ends = [k.start() for k in keys[1:]] + [len(line)]
    info = {k.group(1): line[k.end() : end].strip() for k, end in zip(keys, ends, strict=True)}
    info.setdefault("RestartCnt", info.get("Restarts", ""))  # scontrol calls it Restarts; sacct RestartCnt
    return info


def wait(job_id, timeout: float = 180) -> dict[str, str]:
    """Poll the job until its state is final and return job_info(); scancel it and raise on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info.get("JobState") not in NOT_FINISHED:
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job_id)], capture_output=True)
            raise TimeoutError(f"job {job_id} not finished after {timeout} s: {info.get('JobState')}")
        time.sleep(0.2)
