"""The fault injection of tests/inject: its table says what each variable does through which hook, and each
variable, set, patches that hook and fires. A fault that stopped firing would let the test using it pass on
a run in which nothing went wrong."""

import ast
import json
import re
import subprocess
import sys
import time

from helpers import HANG, INJECT, REPO, clean_env

SITE = REPO / "tests" / "inject" / "sitecustomize.py"
ROW = re.compile(r"^([A-Z_]+)=\S+ +(\S.*?\S) {2,}\S")  # variable=value, hook(s), what it does

# Run as rank 0 with every variable at once, in a file named train.py (NO_UNPICKLE's processes): each fault
# fires at its own count of steps or saves, the one that kills in a forked child, then the late release.
ENV = dict(FAULT_RANK=0, FAULT_NAN=1, FAULT_FULL=2, FAULT_STEP=3, FAULT_SLEEP=0.25, FAULT_ENOSPC=2, FAULT_SAVE=3,
           FAULT_SLOW_SAVE=0.5, FAULT_SLOW=3, FAULT_TORCH="1.0.0", NO_DROPOUT=1, NO_UNPICKLE=1, LATE_RELEASE=1)  # fmt: skip
PROBE = """
import errno, json, os, pickle, sys, time
import torch, torch.distributed as dist
from torch.utils.data import DistributedSampler
from common import data

folder, hooks = sys.argv[2], json.loads(sys.argv[3])  # after --output-dir: FAULT_FULL fills it
seen = {"hooks": {}, "sleeps": []}
for hook in hooks:  # the object each hook names, in the namespaces the table's names come from
    first, *rest = hook.split(".")
    found = {**vars(dist), **vars(torch.utils.data), "torch": torch, "pickle": pickle, "common": __import__("common")}
    obj = found[first]
    for name in rest:
        obj = getattr(obj, name)
    seen["hooks"][hook] = obj if isinstance(obj, str) else obj.__module__
time.sleep = seen["sleeps"].append  # the faults' waits, recorded instead of waited
write, written = os.write, []

def small_disk(fd, chunk):  # FAULT_FULL's filler meets a disk of 1 MiB
    if sum(written) >= 2**20:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    written.append(len(chunk))
    return write(fd, chunk)

os.write = small_disk
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.Adadelta(model.parameters())
for step in (1, 2, 3):
    model(torch.ones(2, 4)).sum().backward()
    try:
        optimizer.step()
    except RuntimeError as err:
        seen["step_error"] = (step, str(err))
    if step == 1:
        seen["nan_after_step_1"] = bool(model.weight.isnan().all())
seen["filler"] = os.path.getsize(os.path.join(folder, "filler"))
os.write = write
torch.mm(torch.ones(64, 64), torch.ones(64, 64))
tensor = torch.ones(1000)
torch.save(tensor, os.path.join(folder, "whole.pt"))
try:
    torch.save(tensor, os.path.join(folder, "enospc.pt"))
except OSError as err:
    seen["enospc"] = err.errno == errno.ENOSPC
pid = os.fork()
if pid == 0:
    torch.save(tensor, os.path.join(folder, "killed.pt"))
    os._exit(0)
seen["child_status"] = os.waitpid(pid, 0)[1]
seen["sizes"] = {name: os.path.getsize(os.path.join(folder, name)) for name in ("whole.pt", "enospc.pt", "killed.pt")}
list(DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False))
data.Images("probe", torch.zeros(4, 1, 2, 2, dtype=torch.uint8), torch.zeros(4), (0,), (1,), 10)[[3, 1]]
seen["dropout"] = torch.nn.Dropout(0.9).train()(torch.ones(100)).tolist() == [1.0] * 100
for name, load in [("pickle.loads", lambda: pickle.loads(pickle.dumps(1))),
                   ("torch.load", lambda: torch.load(os.path.join(folder, "whole.pt"), weights_only=False))]:
    try:
        load()
    except RuntimeError as err:
        seen[name] = str(err)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.destroy_process_group()
seen["end"] = time.time()
print(json.dumps(seen), flush=True)
"""


def table():
    """{variable: hooks} from the docstring's table."""
    rows = [ROW.match(line) for line in ast.get_docstring(ast.parse(SITE.read_text())).splitlines()]
    return {row[1]: row[2].split(", ") for row in rows if row}


def test_the_table_names_every_variable_the_code_reads():
    code = SITE.read_text().split('"""', 2)[2]
    read = set(re.findall(r'env(?:\.get\(|\[)"([A-Z_]+)"|"([A-Z_]+)" in env', code))
    read = {a or b for a, b in read} - {"RANK", "SLURM_PROCID", "SLURM_STEP_ID", "FAULT_RANK"}
    assert read == set(table()) == set(ENV) - {"FAULT_RANK"} | {"RECORD_SAMPLES", "RECORD_BATCHES"}


def test_each_fault_patches_its_hook_and_fires(tmp_path):
    hooks = sorted({hook for hooks in table().values() for hook in hooks})
    (tmp_path / "train.py").write_text(PROBE)
    records = {name: tmp_path / f"{name}.jsonl" for name in ("RECORD_SAMPLES", "RECORD_BATCHES")}
    env = clean_env(PYTHONPATH=f"{INJECT}:{REPO}", **ENV, **records)
    out = subprocess.run([sys.executable, "train.py", "--output-dir", str(tmp_path), json.dumps(hooks)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=HANG)  # fmt: skip
    ended = time.time()
    seen = json.loads(out.stdout.splitlines()[-1])
    version = seen["hooks"].pop("torch.__version__")
    assert version == "1.0.0" and set(seen["hooks"].values()) == {"sitecustomize"}, seen["hooks"]
    assert seen["nan_after_step_1"] and seen["filler"] == 2**20
    assert seen["step_error"] == [3, "injected fault: rank 0 at step 3"]
    sleeps = seen["sleeps"]  # two steps (the third raised first), the product, two saves (the third in the child)
    assert sleeps[:2] == [0.25] * 2 and sleeps[2] > 0 and sleeps[3:] == [0.5] * 2, sleeps
    assert seen["enospc"] and seen["child_status"] == 9  # killed by SIGKILL
    whole = seen["sizes"].pop("whole.pt")  # the others hold half of theirs: their names, in the archive, differ
    assert all(abs(size - whole / 2) < 20 for size in seen["sizes"].values()), (whole, seen["sizes"])
    assert json.loads(records["RECORD_SAMPLES"].read_text()) == {"rank": 1, "epoch": 0, "indices": [1, 3, 5, 7, 9]}
    assert json.loads(records["RECORD_BATCHES"].read_text()) == {"rank": "0", "size": 4, "indices": [3, 1]}
    assert seen["dropout"]
    assert "injected check: pickle.loads" in seen["pickle.loads"]
    assert "injected check: torch.load(weights_only=False)" in seen["torch.load"]
    assert ended - seen["end"] >= 1  # rank 0 held the GIL past its last line
