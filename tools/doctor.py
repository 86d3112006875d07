"""The cluster doctor: before your first multi-node job, launched exactly as a training stage is (python,
torchrun, srun) and with that job's resources, it checks what the job will need and prints one verdict
per line, PASS, WARN or FAIL, each with its fix.

    make doctor                                       # this machine: two gloo ranks under torchrun
    torchrun --standalone --nproc-per-node=N tools/doctor.py
    cd tools && sbatch doctor.slurm                   # your cluster: give it your job's #SBATCH lines

Every rank gathers its facts (GPU, CPUs, versions, network, the data of the task (--task, as the stages'),
files, Slurm) and runs the collectives (exact all-reduces, a bandwidth sweep, a fixed computation to find a
slow rank); rank 0 prints the table and writes it, with every rank's facts, to <output-dir>/doctor.json.
Exit status 1 if a line FAILs.
A rank that never arrives, or stops answering, ends the doctor within --dist-timeout with the one-line
error a training run would print.
"""

import argparse
import errno
import ipaddress
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common/ sits beside tools/
from common.guards import early  # noqa: E402

if __name__ == "__main__":  # run (tests import it): before torch, an old one or a stop in its imports is one line
    early.start(__file__)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import cli, distributed  # noqa: E402
from common.checkpoint import atomic  # noqa: E402
from common.environment import count, cpus_per_rank  # noqa: E402
from common.guards import check, datafiles, failure, flightrecorder, options, preemption, preflight, rails, versions  # noqa: E402
from common.options import flags  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]  # every dtype the stages all-reduce or train in
FLOOR_GBPS = {"within nodes": 5, "across nodes": 1}  # busbw below PCIe 3 x16 / 10 GbE: the fast links are not used
SLOW, VERY_SLOW = 1.5, 3  # a rank's compute time over the median: WARN, FAIL
FIX = {
    "gpu": "ask Slurm for one task per GPU (--ntasks-per-node = the N of --gres=gpu:N) and let setup() pick local_rank's GPU",
    "software": "use one environment on every node: the same module, venv or container, and the same checkout",
    "network": "set MASTER_ADDR to rank 0's host name (srun tasks find it themselves), resolving alike on every node",
    "data": "give every rank the same data: copy it to every node's --data-dir (`make data` on a login node), or put it on a shared filesystem",
    "output": "choose an --output-dir every node can write",
    "slow": "look at that host: another job on its GPU or CPUs, thermal throttling, a lower clock (nvidia-smi -q -d CLOCK)",
}


def parse_args():
    """The doctor's options and those of its task (--task, as the stages take it): (args, the task, the
    arguments the task's datasets() sees: a training run's defaults, with --data-dir and the task's options)."""
    # --task first: the task file adds options of its own; flags in full, as the stages take them
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--task", type=Path, default=cli.TASK)
    path = first.parse_known_args()[0].task
    task = cli.load_task(path)
    p = check.Parser(
        description="check a cluster for multi-node training, launched as a training stage is", allow_abbrev=False
    )
    p.add_argument(
        "--task",
        type=Path,
        default=cli.TASK,
        help="as the stages': its training and test sets are loaded and compared on every rank (default: common/tasks/images.py, MNIST)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=cli.REPO / "data",
        help="as the stages': where the task finds its data (default: the repository's data/)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=cli.default_output_dir(cli.REPO / "doctor" / "doctor.py"),
        help="doctor.json, and a file per rank to see which nodes share it (default: runs/doctor/<job id, torchrun id or local-time-pid>)",
    )
    p.add_argument(
        "--num-workers",
        type=options.number(int, "[0, inf)"),
        help="the DataLoader workers per rank your training uses (default: those of --loader classic)",
    )
    p.add_argument(
        "--dist-timeout",
        type=options.number(int, "[1, 86400]"),
        default=60,
        help="seconds any wait for the other ranks may last (default: 60)",
    )
    p.add_argument("--no-cuda", action="store_true", help="check the CPU and gloo path even where GPUs are visible")
    if hasattr(task, "add_arguments"):
        task.add_arguments(p.add_argument_group(f"the task's options ({path.name})"))
    p.set_defaults(batch_size=0, sync_bn=False)  # what setup() checks of a training run: the doctor trains nothing
    args = p.parse_args()
    if problem := options.out_of_range(argparse.Namespace(**vars(args) | {"batch_size": None})):  # the task's
        p.error(problem)
    training = argparse.Namespace(**vars(cli.parser(Path(__file__), [flags.add]).parse_args([])) | vars(args))
    if hasattr(task, "check") and (problem := task.check(training)):
        p.error(problem)
    return args, task, training


def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def cpulist(text):
    """The CPUs of a sysfs cpulist ("0-3,8-11")."""
    ranges = [part.partition("-") for part in text.strip().split(",") if part]
    return {cpu for lo, _, hi in ranges for cpu in range(int(lo), int(hi or lo) + 1)}


def numa_nodes(cpus, sysfs=Path("/sys")):
    """The NUMA nodes holding `cpus`, from sysfs (none where it does not say)."""
    nodes = (sysfs / "devices/system/node").glob("node[0-9]*")
    return sorted(int(node.name[4:]) for node in nodes if cpus & cpulist((node / "cpulist").read_text()))


def beside_gpu(cpus, bus, sysfs=Path("/sys")):
    """(the NUMA node of the GPU at PCI address `bus`, those of `cpus` off it), from sysfs; None where the
    machine does not say (no numa_node file, or -1: one node, or firmware that does not tell)."""
    try:
        node = int((sysfs / "bus/pci/devices" / bus.lower() / "numa_node").read_text())
        near = cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None
    return (node, sorted(cpus - near)) if node >= 0 else None


def interface_to(ip):
    """The interface and address this host sends from toward `ip`: where the collectives leave."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))  # UDP: picks the route, sends nothing
        mine = s.getsockname()[0]
    for line in run("ip", "-o", "-4", "addr").splitlines():  # "2: eth0    inet 10.0.0.1/24 ..."
        if line.split()[3].split("/")[0] == mine:
            return f"{line.split()[1]} {mine}"
    return mine


def data_facts(task, training):
    """The fingerprints (preflight.fingerprint) of the task's training and test sets as this rank loads
    them, or why it cannot load them."""
    try:
        datafiles.check(training)  # its files first, as a stage checks them: a short labels file trains on less
        return {"fingerprints": [preflight.fingerprint(s) for s in task.datasets(training)[:2]], "error": None}
    except (Exception, SystemExit) as err:  # the task's own code, or its one-line error: anything can fail
        said = failure.refusal(err) or (str(err) if isinstance(err, SystemExit) else None)  # a line already
        cause = said.removeprefix("error: ") if said else f"{type(err).__name__}: {err}"
        return {"fingerprints": None, "error": cause.splitlines()[0] if cause.strip() else type(err).__name__}


def file_facts(args, task, training, rank, world_size):
    """The task's data as this rank sees it; whether it can write --output-dir, which ranks' files it sees
    there (on a shared folder, all of them), and the free space."""
    run = [os.urandom(4).hex()]  # this doctor's: a file one that died left is no rank's here (it said "shared")
    if dist.is_initialized():
        dist.broadcast_object_list(run)
    probe = lambda r: args.output_dir / f".doctor-{run[0]}-{r}"  # noqa: E731
    try:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe(rank), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW))  # a link: not followed
        problem, disk = None, os.statvfs(args.output_dir)
    except OSError as err:  # the folder, or one above it, a file: as the stages say it (guards/lock.py)
        file = err.errno in (errno.EEXIST, errno.ENOTDIR)
        problem = f"{args.output_dir} is a file, or inside one, not a folder" if file else None
        problem = problem or f"cannot write {err.filename} ({err.strerror})"
    if dist.is_initialized():
        dist.barrier()  # every rank has written its file
    sees = [r for r in range(world_size) if probe(r).exists()]
    return {
        "data": data_facts(task, training),
        "output": problem,
        "probe": str(probe(rank)),
        "sees": sees,
        "free_gb": 0 if problem else disk.f_bavail * disk.f_frsize / 1e9,
    }


def visible(env=os.environ):
    """The GPUs CUDA_VISIBLE_DEVICES names, as CUDA reads it: up to the first entry that names none (-1 and NoDevFiles
    hide them all). A GPU torch can use, but --no-cuda leaves idle, is not one the ranks train on."""
    ids = []
    for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
        if not (entry.strip().isdigit() or entry.strip().startswith(("GPU-", "MIG-"))):
            break
        ids.append(entry.strip())
    return ids


def facts(args, local_rank, device):
    """What this rank finds out about itself, with no other rank involved."""
    gpus, gpu, beside = 0, None, None
    cpus, addr = os.sched_getaffinity(0), distributed.launcher().addr or "127.0.0.1"  # after any binding
    if device.type == "cuda":
        props, gpus = torch.cuda.get_device_properties(device), torch.cuda.device_count()
        gpu, bus = str(props.uuid), f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        beside = beside_gpu(cpus, bus)
    elif (ids := visible()) and not torch.cuda.is_available():  # no GPU here: the one Slurm gave this rank stands in
        gpus, pick = len(ids), 0 if len(ids) == 1 else local_rank  # as setup() picks
        gpu = f"CUDA_VISIBLE_DEVICES {ids[pick]}" if pick < len(ids) else None
    ip = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    ifname = "NCCL_SOCKET_IFNAME" if device.type == "cuda" else "GLOO_SOCKET_IFNAME"
    slurm = ("SLURM_STEP_ID", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE")
    return {
        "host": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "gpus": gpus, "gpu": gpu, "beside_gpu": beside,
        "cpus": len(cpus), "cpu_numa": numa_nodes(cpus), "cpus_per_rank": cpus_per_rank(),
        "workers": cpus_per_rank() - 1 if args.num_workers is None else args.num_workers,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "CUDA": str(torch.version.cuda),
            "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none",
            "project": run("git", "-C", str(cli.REPO), "describe", "--always", "--dirty") or "unknown",
        },
        "master": f"{addr} = {ip}", "loopback": ipaddress.ip_address(ip).is_loopback,
        "interface": f"{interface_to(ip)} ({ifname}={os.environ.get(ifname, 'unset')})",
        "slurm": {k: os.environ.get(k) for k in slurm},
    }  # fmt: skip


def exact_all_reduce(device, rank, world_size):
    """All-reduce a pattern whose every element sums to exactly 1 (rank r contributes the elements i with
    i % world_size == r), in every dtype and at sizes that split unevenly: what came back wrong, if anything."""
    wrong = []
    for dtype in DTYPES:
        for n in (1, 4097, 2**20 + 1):
            x = (torch.arange(n, device=device) % world_size == rank).to(dtype)
            dist.all_reduce(x)
            if bad := int((x != 1).sum()):
                wrong.append(f"{str(dtype)[6:]} x {n}: {bad} elements wrong on rank {rank}")
    return wrong


def bandwidth(device, group, sizes):
    """(bytes, algbw, busbw in GB/s) of all-reduces in `group`: busbw = algbw x 2(n-1)/n, what a ring
    moves over each link, comparable across sizes and world sizes (nccl-tests' definition)."""
    n, results = dist.get_world_size(group), []
    for size in sizes:
        x = torch.ones(size // 4, device=device)
        dist.all_reduce(x, group=group)  # warm-up: connections, buffers
        iters = 5
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        algbw = size * iters / (time.perf_counter() - start) / 1e9
        results.append((size, round(algbw, 3), round(algbw * 2 * (n - 1) / n, 3)))
    return results


def compute_time(device):
    """Seconds for a fixed computation, the best of five: a rank much slower than the others holds every step back.
    On CPUs on one thread, so that ranks sharing a node's cores (more threads than cores) compare alike."""
    torch.set_num_threads(1)
    n = 4096 if device.type == "cuda" else 384  # tens of milliseconds either way
    a = torch.rand(n, n, device=device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(a, a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def transport(device, log):
    """How the collectives travel: NCCL's own account of each connection (P2P, SHM, NET/IB, NET/Socket)."""
    if device.type != "cuda":
        return "gloo over TCP sockets"
    text = log.read_text() if log and log.exists() else ""
    vias = sorted(set(re.findall(r" via (NET/\w+|\w+)", text)))
    return ", ".join(vias) or "unknown (NCCL_DEBUG was set by you, or NCCL logged no connection)"


def requeue():
    """What Slurm will do at preemption or the time limit: Requeue= of the job, and the --signal of its script
    (Slurm shows the signal nowhere else; one given on sbatch's command line is not seen)."""
    job = os.environ["SLURM_JOB_ID"]
    requeued = re.search(r"Requeue=(\d)", run("scontrol", "show", "job", job))
    return requeued and requeued[1], preemption.job_signal(job)


def gather(obj):
    everyone = [obj] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, obj)
    return everyone


def who(ranks):
    return ", ".join(f"rank {f['rank']} ({f['host']})" for f in ranks)


def verdict(check, problems, ok, fix, worse="FAIL"):
    """A row of the table: PASS and what was seen, or `worse` with the problems (naming ranks, hosts) and the fix."""
    return (check, worse if problems else "PASS", "; ".join(problems) or ok, fix if problems else "")


def by(everyone, key):
    """{value: the ranks' facts with that value of `key`}, in rank order."""
    groups = {}
    for f in everyone:
        groups.setdefault(f[key], []).append(f)
    return groups


def check_ranks(run):
    hosts = ", ".join(f"{h} (ranks {', '.join(str(f['rank']) for f in fs)})" for h, fs in run.hosts.items())
    yield verdict(
        "ranks", [], f"{len(run.everyone)} arrived within --dist-timeout {run.args.dist_timeout} s: {hosts}", ""
    )


def check_ranks_per_node(run):
    """A rank per GPU of each node: the GPUs a rank sees, or, where each sees its own alone (--gpus-per-task=1,
    --gpu-bind=single:1), the distinct ones the node's ranks use (it failed such a binding, which trains well)."""
    gpus = {h: max(fs[0]["gpus"], len({f["gpu"] for f in fs if f["gpu"]})) for h, fs in run.hosts.items()}
    uneven = [f"{h}: {len(fs)} ranks, {gpus[h]} GPUs" for h, fs in run.hosts.items() if gpus[h] and len(fs) != gpus[h]]
    shared = any(len(fs) > gpus[h] > 0 for h, fs in run.hosts.items())  # more ranks than GPUs share them; fewer idle
    ok = "one per GPU" if run.everyone[0]["gpus"] else "no GPU"
    yield verdict("ranks per node", uneven, ok, FIX["gpu"], worse="FAIL" if shared else "WARN")


def check_gpu_per_rank(run):
    users = by([f | {"where": (f["host"], f["gpu"])} for f in run.everyone if f["gpu"]], "where")
    shared = [f"{who(fs)} all use {where[1]}" for where, fs in users.items() if len(fs) > 1]
    yield verdict("GPU per rank", shared, f"{len(users)} GPUs, one per rank" if users else "no GPU", FIX["gpu"])


def check_numa(run):
    """Each rank's CPUs (its affinity, after any binding) on its GPU's NUMA node: memory it copies to the GPU stays
    near it. A rank whose CPUs span nodes, unbound, has some of them far."""
    told = [f for f in run.everyone if f["beside_gpu"]]
    far = [f"{who([f])}: {len(off)} of its {f['cpus']} CPUs off NUMA node {node}, its GPU's ({ranges(off)})"
           + (": none on it, so torchrun --numa-binding=node cannot bind it (the job scripts run unbound, "
              "common/guards/numa.py)" if len(off) == f["cpus"] else "")
           for f in told for node, off in [f["beside_gpu"]] if off]  # fmt: skip
    fix = ("bind each rank beside its GPU: torchrun --numa-binding=node (torch >= 2.9); srun --cpu-bind=cores with "
           "the GPUs' cores in gres.conf (Cores=), or --cpu-bind=map_ldom:<the GPUs' nodes>")  # fmt: skip
    seen = f"each rank's CPUs on its GPU's NUMA node ({len(told)} of {len(run.everyone)} ranks' nodes known)"
    if not told:
        seen = "unknown: sysfs gives no GPU's NUMA node (one node, or not said)"
    yield verdict("NUMA", far, seen if run.gpu else "skipped: no GPU", fix, "WARN")


def ranges(cpus):
    """Sorted CPUs as a cpulist: [0, 1, 2, 5] -> "0-2,5"."""
    runs = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)


def check_cpus_per_rank(run):
    short = [f"{who([f])}: {f['cpus_per_rank']} CPUs for {f['workers']} DataLoader workers + 1" for f in run.everyone
             if f["cpus_per_rank"] < f["workers"] + 1]  # fmt: skip
    least = min(f["cpus_per_rank"] for f in run.everyone)
    ok = f"{least} at least, for {run.everyone[0]['workers']} DataLoader workers + 1"
    fix = "--cpus-per-task = workers + 1, exported to srun (SRUN_CPUS_PER_TASK), or fewer --num-workers"
    yield verdict("CPUs per rank", short, ok, fix, "WARN")


def check_versions(run):
    for name in run.everyone[0]["versions"]:
        values = by([f | {"version": f["versions"][name]} for f in run.everyone], "version")
        usual = max(values, key=lambda v: len(values[v]))
        odd = [f"{who(fs)}: {v}, the others {usual}" for v, fs in values.items() if v != usual]
        yield verdict(f"{name} version", odd, f"{usual} on every rank", FIX["software"])


def check_torch_minimum(run):
    torches = by([f | {"torch": f["versions"]["torch"]} for f in run.everyone], "torch")
    short = {v: versions.short(v) for v in torches}  # {version: {stage or tool: the torch it needs}}
    old = [f"{who(torches[v])}: {v}, where " + ", ".join(f"{s} needs ≥ {m}" for s, m in needs.items())
           for v, needs in short.items() if needs]  # fmt: skip
    none_runs = any(len(needs) == len(versions.TORCH) for needs in short.values())
    fix = versions.fix(max(versions.TORCH.values(), key=versions.release))
    yield verdict(
        "torch minimum", old, f"every stage runs on {', '.join(torches)}", fix, "FAIL" if none_runs else "WARN"
    )


def check_master_addr(run):
    loopback = [f"{who([f])}: a loopback address on {run.nodes} nodes" for f in run.everyone if f["loopback"]]
    masters = by(run.everyone, "master")
    differ = [f"{who(fs)}: {m}" for m, fs in masters.items()] if len(masters) > 1 else []
    ok = f"{run.everyone[0]['master']} on every rank"
    yield verdict("MASTER_ADDR", (loopback if run.nodes > 1 else []) + differ, ok, FIX["network"])


def check_interface(run):
    seen = {h: fs[0]["interface"] for h, fs in run.hosts.items()}
    loopback = [f"{h}: {i}, loopback" for h, i in seen.items() if run.nodes > 1 and i.startswith("lo ")]
    fix = "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the network the nodes share"
    yield verdict("interface", loopback, "; ".join(f"{h}: {i}" for h, i in seen.items()), fix)


def check_transport(run):
    ways = sorted({f["transport"] for f in run.everyone})
    sockets = run.gpu and run.nodes > 1 and any("NET/Socket" in w for w in ways)
    problems = [f"NCCL uses TCP sockets between nodes ({', '.join(ways)})"] if sockets else []
    fix = "check the InfiniBand/RoCE drivers and NCCL's net plugin (NCCL_DEBUG=INFO says why)"
    yield verdict("transport", problems, " / ".join(ways), fix, "WARN")


def check_all_reduce(run):
    wrong = [w for f in run.everyone for w in f["all_reduce"]]
    dtypes = ", ".join(str(d)[6:] for d in DTYPES)
    ok = f"exact in {dtypes}, 1 to 2^20+1 elements" if len(run.everyone) > 1 else "one rank: nothing to reduce"
    yield verdict("all-reduce", wrong, ok, "a broken GPU, driver or network: run nccl-tests on these hosts")


def check_bandwidth(run):
    fix = "see the transport line; check NCCL_SOCKET_IFNAME and the links (nvidia-smi topo -m)"
    for scope in dict.fromkeys(scope for f in run.everyone for scope in f["bandwidth"]):  # rank 0's alone missed
        measured = [f for f in run.everyone if scope in f["bandwidth"]]  # a slow node, or every one where it had none
        slowest = min(measured, key=lambda f: f["bandwidth"][scope][-1][2])  # a collective goes at its pace
        sweep = slowest["bandwidth"][scope]
        size, algbw, busbw = sweep[-1]
        smaller = ", ".join(f"{b:.3g} at {s / 2**20:g} MiB" for s, _, b in sweep[:-1])
        seen = f"busbw {busbw:.3g} GB/s (algbw {algbw:.3g}) at {size / 2**20:g} MiB, {smaller}"
        seen += f", {who([slowest])}'s, the slowest" if len(measured) > 1 else ""
        slow = [f"{seen}: below {FLOOR_GBPS[scope]} GB/s"] if run.gpu and busbw < FLOOR_GBPS[scope] else []
        yield verdict(f"busbw {scope}", slow, seen + ("" if run.gpu else " (gloo on CPUs: no floor)"), fix, "WARN")


def check_stragglers(run):
    median = statistics.median_low(f["compute_s"] for f in run.everyone)
    slowest = max(run.everyone, key=lambda f: f["compute_s"])
    ratio, seen = (
        slowest["compute_s"] / median,
        f"{who([slowest])}: {slowest['compute_s'] * 1e3:.0f} ms for a fixed computation",
    )
    slow = [f"{seen}, {ratio:.1f}x the median {median * 1e3:.0f} ms"] if ratio > SLOW else []
    ok = f"the slowest, {seen}, {ratio:.1f}x the median"
    yield verdict("stragglers", slow, ok, FIX["slow"], "FAIL" if ratio > VERY_SLOW else "WARN")


def check_data(run):
    """The task's training and test sets: loaded on every rank, and alike (as preflight.agree() will require)."""
    broken = [f"{who([f])}: cannot load it ({f['data']['error']})" for f in run.everyone if f["data"]["error"]]
    loaded = by([f | {"sets": " / ".join(f["data"]["fingerprints"])} for f in run.everyone if not f["data"]["error"]],
                "sets")  # fmt: skip
    usual = max(loaded, key=lambda v: len(loaded[v]), default=None)
    differ = [
        f"{who([f])}: training / test set {sets}, the others {usual}"
        for sets, fs in loaded.items()
        if sets != usual
        for f in fs
    ]
    ok = f"{run.args.task.name}'s training / test set alike on every rank: {usual}"
    yield verdict("data", broken + differ, ok, FIX["data"])


def check_output_folder(run):
    unwritable = [f"{who([f])}: {f['output']}" for f in run.everyone if f["output"]]
    shared = all(len(f["sees"]) == len(run.everyone) for f in run.everyone)
    free = min(f["free_gb"] for f in run.everyone)
    ok = f"writable on every rank, {free:.0f} GB free; " + (
        "shared by every node" if shared else "not shared: each node has its own"
    )
    yield verdict("output folder", unwritable, ok, FIX["output"])


def check_slurm_resources(run):
    steps = [f for f in run.everyone if f["slurm"]["SLURM_STEP_ID"]]
    problems = []
    for f in steps:
        asked = {k: f["slurm"][k] for k in ("SLURM_CPUS_PER_TASK", "SLURM_GPUS_ON_NODE")}
        problems += [f"{who([f])}: {k}={v!r} is not a count" for k, v in asked.items() if v and count(v) is None]
        cpus, gpus = (count(v) for v in asked.values())
        if (cpus or 0) > f["cpus"]:
            problems.append(f"{who([f])}: {f['cpus']} CPUs of --cpus-per-task={cpus}")
        if gpus is not None and gpus != f["gpus"]:
            problems.append(f"{who([f])}: sees {f['gpus']} GPUs of SLURM_GPUS_ON_NODE={gpus}")
    if any(f["slurm"]["SLURM_CPUS_PER_TASK"] and not f["slurm"]["SRUN_CPUS_PER_TASK"] for f in steps):
        problems.append("SRUN_CPUS_PER_TASK is unset: srun of Slurm 22.05-23.02 gives each task 1 CPU")
    fix = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before srun; ask for no more than the nodes have"
    yield verdict("Slurm CPUs, GPUs", problems, "as asked, on every rank" if steps else "not an srun step", fix, "WARN")


def check_requeue(run):
    if not run.everyone[0]["requeue"]:
        return  # not an srun step: nothing to ask Slurm
    requeued, signal = run.everyone[0]["requeue"]
    problems = []
    if requeued is None:
        problems.append(f"scontrol does not show job {os.environ['SLURM_JOB_ID']}")
    elif requeued == "0":
        problems.append(f"Requeue={requeued}: a preempted job does not come back")
    if not signal:
        problems.append("no --signal in the job script: the time limit ends the job without a requeue")
    elif preemption.lead(signal) < preemption.lead_needed(0):  # the run's own rule, with its save time
        problems.append(f"--signal={signal} leaves {preemption.lead(signal)} s: less than a save's margin "
                        f"({preemption.MARGIN} s) before the time limit")  # fmt: skip
    fix = "#SBATCH --requeue and --signal=B:USR1@90, with the USR1 trap of 04_ddp_multi_node/job.slurm"
    yield verdict("requeue", problems, f"Requeue=1, --signal={signal}", fix, "WARN")


CHECKS = [
    check_ranks, check_ranks_per_node, check_gpu_per_rank, check_numa, check_cpus_per_rank, check_versions,
    check_torch_minimum,
    check_master_addr, check_interface, check_transport, check_all_reduce, check_bandwidth, check_stragglers,
    check_data, check_output_folder, check_slurm_resources, check_requeue,
]  # fmt: skip


def judge(args, everyone, device):
    """The verdicts, from every rank's facts: (check, PASS/WARN/FAIL, what was found, the fix), a row or more
    per check of CHECKS. A check that finds problems lists them, naming the ranks and hosts; one that finds
    none says what it saw."""
    hosts = by(everyone, "host")
    run = SimpleNamespace(args=args, everyone=everyone, hosts=hosts, nodes=len(hosts), gpu=device.type == "cuda")
    return [row for check in CHECKS for row in check(run)]


def main(guard):
    args, task, training = parse_args()
    nccl_log = None
    if torch.cuda.is_available() and not args.no_cuda:  # a collective that hangs: each rank's last ones, on disk
        args.output_dir.mkdir(parents=True, exist_ok=True)  # as the job scripts set it, unless set before
        for name, value in flightrecorder.variables(flightrecorder.prefix(args.output_dir)).items():
            os.environ.setdefault(name, value)
    if torch.cuda.is_available() and not args.no_cuda and "NCCL_DEBUG" not in os.environ:
        # NCCL names the transport of each connection: into a file per process, read after the collectives
        nccl_log = args.output_dir / f"nccl-{socket.gethostname().split('.')[0]}-{os.getpid()}.log"
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(args.output_dir / "nccl-%h-%p.log"))
        args.output_dir.mkdir(parents=True, exist_ok=True)
    guard.meet(args)  # bounded, and named: the rendezvous of setup(), watched from outside
    rank, local_rank, world_size, device = distributed.setup(args)
    mine = {"rank": rank, **facts(args, local_rank, device), **file_facts(args, task, training, rank, world_size)}
    hosts = gather(mine["host"])
    mine.update(all_reduce=[], bandwidth={}, compute_s=compute_time(device), requeue=None)
    if world_size > 1:
        mine["all_reduce"] = exact_all_reduce(device, rank, world_size)
        sizes = [2**20, 2**24, 2**28] if device.type == "cuda" else [2**16, 2**19, 2**22]  # up to 256 MiB; 4 MiB
        nodes = sorted(set(hosts), key=hosts.index)
        groups = {h: dist.new_group([r for r, x in enumerate(hosts) if x == h]) for h in nodes}  # every rank makes each
        if len(nodes) > 1:
            mine["bandwidth"]["across nodes"] = bandwidth(device, None, sizes)
        if hosts.count(mine["host"]) > 1:  # each node's ranks among themselves, every node at once
            mine["bandwidth"]["within nodes"] = bandwidth(device, groups[mine["host"]], sizes)
    mine["transport"] = transport(device, nccl_log)
    if rank == 0 and mine["slurm"]["SLURM_STEP_ID"]:
        mine["requeue"] = requeue()
    everyone = gather(mine)
    if not mine["output"]:
        Path(mine["probe"]).unlink()
    rows = judge(args, everyone, device)
    if rank == 0:
        nodes = len(set(hosts))
        print(
            f"doctor: {world_size} ranks on {nodes} node{'s' * (nodes > 1)}, {device.type}, job {os.environ.get('SLURM_JOB_ID', 'none')}"
        )
        for check, status, detail, fix in rows:
            print(f"{status:<4}  {check:<18} {detail}" + (f"  ->  fix: {fix}" if fix else ""), flush=True)
        report = {"checks": [dict(check=c, status=s, detail=d, fix=f) for c, s, d, f in rows], "ranks": everyone}
        try:
            with atomic(args.output_dir / "doctor.json", "w") as f:  # a link there replaced, never followed
                json.dump(report, f, indent=1)
            print(f"report: {args.output_dir / 'doctor.json'} (tools/plan.py --doctor reads its bandwidth)")
        except OSError as err:
            print(
                f"error: cannot write {args.output_dir}/doctor.json ({err.strerror}): the table above is the report",
                file=sys.stderr,
            )
    distributed.cleanup()
    sys.exit(1 if any(status == "FAIL" for _, status, _, _ in rows) else 0)


if __name__ == "__main__":
    rails.run(main)  # a failed collective names the rank that went silent
