"""The oldest torch each stage and the doctor run on, and one line instead of a traceback below it.

"Runs" means its tests pass, on CPUs with gloo: it trains, resumes, restarts and fails as the newest torch
does. Found on PyPI's releases, and kept so by `make test-min`. Below the minimum:
  01, 02: torch 2.2 has no torch.amp.GradScaler(device), nor device_id in init_process_group (03-05, doctor).
  03, 04, doctor: on 2.3 a worker that torchrun restarts cannot rejoin (RendezvousClosedError); on 2.4 a
      MASTER_PORT another program holds leaves rank 1 waiting forever; on 2.5 and 2.6 it is a traceback.
  05: fully_shard is not in torch.distributed.fsdp before 2.6 and fails in its first all-gather on 2.6
      ('Stream' object has no attribute 'record_event'); on 2.7 and 2.8 its gradients on gloo are the sum
      over the ranks, not the mean (pytorch#162338): it trains, but not as stage 03 does.
torchvision follows: each release is built for one torch (0.18 for 2.3, 0.22 for 2.7, 0.24 for 2.9).
"""

import re
from importlib import metadata
from pathlib import Path

from common.guards.ending import Refusal

TORCH = {  # by the script's folder, which a copied stage keeps; tools: the doctor
    "01_single_gpu": "2.3",
    "02_dataparallel": "2.3",
    "03_ddp_single_node": "2.7",
    "04_ddp_multi_node": "2.7",
    "05_fsdp": "2.9",
    "tools": "2.7",
}


def release(version):
    """The numbers of a version, to compare: 2.6.0+cu124 and 2.6.0a0+git1234 are both (2, 6, 0)."""
    return tuple(int(n) for n in re.match(r"\d+(\.\d+)*", version)[0].split("."))


def needs(script):
    """The oldest torch `script` runs on; for a folder not in the table, the one every stage needs."""
    return TORCH.get(Path(script).resolve().parent.name, min(TORCH.values(), key=release))


def installed():
    """The version of the torch this Python would import, read from its metadata: in a tenth of a second,
    where importing it takes seconds and an old one can fail in the imports. None without metadata."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None  # a source tree on PYTHONPATH, or no torch: the import itself will tell


def short(version):
    """{folder: the torch it needs} of the stages and tools `version` is too old for."""
    return {folder: need for folder, need in TORCH.items() if release(version) < release(need)}


def fix(need):
    return f"`module load` a newer PyTorch or `pip install 'torch>={need}'`"


def require(script):
    """Stop with one line if this torch is older than `script` (a stage's or tool's __file__) runs on.
    Every rank checks for itself: nodes can have different environments (the doctor compares them)."""
    found, need, path = installed(), needs(script), Path(script).resolve()
    if found and release(found) < release(need):
        raise Refusal(f"error: {path.parent.name}/{path.name} needs torch ≥ {need} (this is {found}): {fix(need)}")
