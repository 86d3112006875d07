"""Who am I, where do I run, who are my peers: one answer for python, torchrun and srun.

`setup()` returns `rank, local_rank, world_size, device` in every case, so the training code never
branches on how it was launched. A process group exists whenever a launcher started the process
(torchrun, or srun with one task per GPU); a plain `python train.py` is rank 0 of 1 without one.

No wait for other ranks outlasts --dist-timeout by more than a few seconds, and each says what it
waited for: the rendezvous names the address, the port and the ranks that did not arrive; a failed
collective names the ranks that stopped answering (from the heartbeats every rank keeps in the store).
"""

import contextlib
import datetime
import ipaddress
import os
import re
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from common import cli, data
from common.environment import integer

HEARTBEAT = 1.0  # seconds between a rank's signs of life in the store
_run = {}  # this process's store, address and timeout, for the diagnosis of a failed collective


def expand_hostlist(hostlist):
    """Expand a Slurm hostlist as `scontrol show hostnames` does ("node[01-03,07],r[1-2]n[1-2]") in Python:
    `scontrol` is not always there. Every bracket group counts, the first one varying slowest."""
    if hostlist.count("[") != hostlist.count("]"):
        raise SystemExit(f"error: cannot read the Slurm hostlist {hostlist!r} (unmatched brackets)")
    hosts = []
    for name in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):  # commas inside brackets do not split
        group = re.search(r"\[([^\]]*)\]", name)
        if not group:
            hosts.append(name)
            continue
        for part in group[1].split(","):
            lo, _, hi = part.partition("-")
            if not (lo.isdigit() and (hi or lo).isdigit()):
                raise SystemExit(f"error: cannot read the Slurm hostlist {hostlist!r} (at [{group[1]}])")
            if int(hi or lo) < int(lo):
                raise SystemExit(f"error: cannot read the Slurm hostlist {hostlist!r} (at [{group[1]}])")
            for i in range(int(lo), int(hi or lo) + 1):  # keep zero padding: node01, not node1
                hosts += expand_hostlist(f"{name[: group.start()]}{i:0{len(lo)}d}{name[group.end() :]}")
    return hosts


def master_port(job_id):
    """A port derived from the job id, so two jobs sharing a node do not collide (also in job scripts)."""
    return 20000 + job_id % 40000


def launcher_env(env=os.environ):
    """Read rank, local rank and world size from the launcher's variables, or fail with the fix."""
    if "RANK" in env:  # torchrun; wins over Slurm's variables under `srun torchrun`
        return integer("RANK", env=env), integer("LOCAL_RANK", env=env), integer("WORLD_SIZE", env=env, low=1), True
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun task (the batch shell has no step)
        if not env.get("SLURM_JOB_NODELIST"):
            raise SystemExit("error: SLURM_JOB_NODELIST is not set in this srun task: launch it with srun in a job")
        env.setdefault("MASTER_ADDR", expand_hostlist(env["SLURM_JOB_NODELIST"])[0])
        env.setdefault("MASTER_PORT", str(master_port(integer("SLURM_JOB_ID", env=env))))
        ntasks = integer("SLURM_NTASKS", env=env, low=1)
        return integer("SLURM_PROCID", env=env), integer("SLURM_LOCALID", env=env), ntasks, True
    if integer("SLURM_NTASKS", 1, env=env) > 1:
        raise SystemExit(
            f"error: this job has SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not one of its "
            "tasks (it runs in the batch script or an salloc shell): launch train.py with `srun python "
            "train.py`, or with torchrun"
        )
    return 0, 0, 1, False


def setup(args):
    """Check the launch, pick the device, join the process group: returns rank, local_rank, world_size, device."""
    rank, local_rank, world_size, launched = launcher_env()
    if not (0 <= rank < world_size and 0 <= local_rank <= rank):
        raise SystemExit(f"error: inconsistent launch: rank {rank}, local rank {local_rank}, world size {world_size}")
    # every rank alike, so rank 0 alone says it (a resume keeps --batch-size: it defines the run)
    if args.batch_size % world_size:
        sizes = ", ".join(str(n) for n in range(1, args.batch_size + 1) if args.batch_size % n == 0)
        raise SystemExit(f"error: --batch-size {args.batch_size} is the global batch: it must divide by the world size "
                         f"{world_size}: run on {sizes} ranks" if rank == 0 else 1)  # fmt: skip
    if torch.cuda.is_available() and not args.no_cuda:
        visible = torch.cuda.device_count()
        if visible > 1 and local_rank >= visible:
            raise SystemExit(
                f"error: local rank {local_rank} but only {visible} GPUs are visible on {socket.gethostname()}: "
                "ask Slurm for as many tasks per node as GPUs per node (--ntasks-per-node = --gpus-per-node)"
            )
        device = torch.device("cuda", local_rank if visible > 1 else 0)  # one visible GPU per task: it is 0
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.sync_bn and device.type != "cuda":
        raise SystemExit("error: --sync-bn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only): drop it on CPUs")
    if launched:
        interfaces("nccl" if device.type == "cuda" else "gloo")
        store = rendezvous(rank, world_size, args.dist_timeout)
        with deadline(args.dist_timeout + 5, "the process group did not form although every rank arrived: the "
                      "ranks cannot reach each other's addresses; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to "
                      "the network the nodes share"):  # fmt: skip
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                store=dist.PrefixStore("pg", store),
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=args.dist_timeout),
                device_id=device if device.type == "cuda" else None,
            )
        watch(store, rank)
    return rank, local_rank, world_size, device


class deadline:
    """`with deadline(seconds, why):` ends the process with `why` if the block is still running by then:
    for waits that take no timeout of their own, or ignore it (a TCP connection to a program that
    accepts it but never answers)."""

    def __init__(self, seconds, why):
        self.timer = threading.Timer(seconds, lambda: fail(f"error: rank {os.environ.get('RANK', '?')}: {why}"))
        self.timer.daemon = True

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def fail(message):
    """Print and end this process now, from any thread: a rank stuck in C++ cannot be stopped politely."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def interfaces(backend):
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME must name interfaces this host has: gloo would stop with a
    C++ stack trace, NCCL at its first collective. NCCL takes prefixes ("ib" for ib0), "=" exact names and
    "^" names to avoid; gloo exact names, each of which must exist."""
    name = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    wanted, here = os.environ.get(name, ""), sorted(n for _, n in socket.if_nameindex())
    if not wanted or wanted.startswith("^"):
        return
    names = wanted.lstrip("=").split(",")
    if backend == "nccl":  # one matching interface is enough
        missing = [] if any(h == n or (wanted[0] != "=" and h.startswith(n)) for h in here for n in names) else names
    else:
        missing = [n for n in names if n not in here]
    if missing:
        raise SystemExit(
            f"error: {name}={wanted} but {socket.gethostname()} has no interface {', '.join(missing)} (it has "
            f"{', '.join(here)}): set it to the interface of the network the nodes share, or unset it"
        )


def rendezvous(rank, world_size, timeout):
    """Meet the other ranks in a key-value store on rank 0's MASTER_ADDR:MASTER_PORT (torchrun's own
    store under torchrun), each step bounded by `timeout` and, if it fails, named."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        raise SystemExit(
            "error: RANK is set but MASTER_ADDR or MASTER_PORT is not: export both (rank 0's host and a free port)"
        )
    port, where, host = integer("MASTER_PORT", low=1, high=65535), f"{addr}:{port}", socket.gethostname()
    os.environ["RANK"] = str(rank)  # for the messages of every thread, srun tasks included
    try:
        ip = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as err:
        raise SystemExit(
            f"error: MASTER_ADDR {addr} does not resolve on {host} ({err.strerror}): set it to rank 0's host name or address"
        ) from None
    # an srun task off the first node, rank 0's, that finds a loopback address would wait for itself
    # (under torchrun, torchrun sets MASTER_ADDR)
    off_first = os.environ.get("SLURM_NODEID", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    if off_first and ipaddress.ip_address(ip).is_loopback:
        raise SystemExit(
            f"error: rank {rank} on {host}: MASTER_ADDR {addr} is {ip}, a loopback address, but rank 0 runs on "
            "another node: unset MASTER_ADDR (srun tasks find the first node) or set it to rank 0's host name"
        )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    serve = rank == 0 and not agent
    end = time.monotonic() + timeout
    if not serve:  # wait for the server in Python: torch's client retries silently past its timeout
        while not reachable(addr, port):
            if time.monotonic() > end:
                raise SystemExit(
                    f"error: rank {rank} on {host}: nothing answers at {where} after --dist-timeout {timeout} s: "
                    "rank 0 did not start or failed first (did you launch with srun or torchrun?), or the address is not rank 0's host"
                )
            time.sleep(0.2)
    try:
        with deadline(timeout + 5, f"{where} accepts connections but is no rendezvous store: MASTER_PORT is taken "
                      "by another program; choose another port"):  # fmt: skip
            store = dist.TCPStore(addr, port, world_size, is_master=serve, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err):
            raise SystemExit(
                f"error: MASTER_PORT {port} is in use on {host} by another program: choose another port"
            ) from None
        raise SystemExit(
            f"error: rank {rank} could not reach the rendezvous store at {where}: {str(err).splitlines()[0]}"
        ) from None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if agent:  # torchrun's own store outlives a restart: fresh keys for each (torch's own keys are kept apart alike)
        store = dist.PrefixStore(f"attempt{restart}", store)
    _run.update(store=store, where=where, timeout=timeout, world_size=world_size)
    try:
        store.set(f"host/{rank}", host)
        store.add("restarted", int(restart > 0))
        store.add("arrived", 1)
        while store.add("arrived", 0) < world_size:
            if time.monotonic() > end:
                missing = [r for r in range(world_size) if not store.check([f"host/{r}"])]
                raise SystemExit(
                    f"error: rank {rank}: ranks {', '.join(map(str, missing))} of {world_size} did not arrive at "
                    f"{where} within --dist-timeout {timeout} s: were they started (srun with --ntasks = world size, "
                    "torchrun on every node)? A rank that failed first printed its own error"
                )
            time.sleep(0.1)
        # a torchrun that restarts its workers because another node's failed does not count that restart
        # (torch 2.14): it is one for every rank if it is one for any, so that all of them resume
        if restart == 0 and store.add("restarted", 0):
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    except dist.DistError:
        raise SystemExit(
            f"error: rank {rank}: lost the rendezvous store at {where}: rank 0 ended (its message says why)"
        ) from None
    return store


def reachable(addr, port):
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return True
    except OSError:
        return False


def watch(store, rank):
    """A thread that keeps this rank's heartbeat in the store, and ends the rank when the torchrun that
    started it is gone (a killed launcher must not leave its workers running). A collective that fails
    then names the ranks whose heartbeats stopped."""
    parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

    def beat():
        while not _run["stop"].is_set():
            if parent and os.getppid() != parent:
                fail(f"error: rank {rank}: torchrun (pid {parent}) has ended: this worker ends too")
            try:
                store.set(f"alive/{rank}", str(time.time()))
            except dist.DistError:  # the store went with rank 0: the main thread reports what failed
                return
            _run["stop"].wait(HEARTBEAT)

    _run.update(stop=threading.Event(), beat=threading.Thread(target=beat, daemon=True), rank=rank)
    _run["beat"].start()
    sys.excepthook = failed


def failed(kind, error, tb):
    """sys.excepthook: a failed collective becomes one line naming the ranks that stopped answering."""
    # inside backward(), DDP's reducer turns a failed collective into a RuntimeError from the backend
    backend = issubclass(kind, RuntimeError) and any(name in str(error) for name in ("gloo", "NCCL", "ProcessGroup"))
    if not (issubclass(kind, dist.DistError) or backend):
        return sys.__excepthook__(kind, error, tb)
    rank, store, timeout = os.environ.get("RANK", "?"), _run["store"], _run["timeout"]
    stalled = []

    def ask():  # in a thread: a store on a stopped rank 0 accepts connections and never answers
        time.sleep(3 * HEARTBEAT)  # a rank killed just now (SIGKILL, out of memory) has beaten a moment ago
        now = time.time()
        try:
            for r in range(_run["world_size"]):
                last = float(store.get(f"alive/{r}")) if store.check([f"alive/{r}"]) else 0
                if now - last > 3 * HEARTBEAT:
                    stalled.append(f"{r} ({store.get(f'host/{r}').decode()}, silent for {now - last:.0f} s)")
        except dist.DistError:  # the store ended with rank 0
            stalled.append(f"0 (the store at {_run['where']} is gone)")

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(5 + 3 * HEARTBEAT)
    if asking.is_alive():
        cause = f"rank 0, which holds the store at {_run['where']}, stopped answering"
    elif stalled:
        cause = (f"rank {', rank '.join(stalled)} ended or stopped answering: killed (out of memory, a signal; "
                 "its own error, if it had one, is above), stopped, hung or swapping")  # fmt: skip
    else:
        cause = "every rank still answers: see the collective's error"
    fail(f"error: rank {rank}: a collective failed within --dist-timeout {timeout} s: {cause} "
         f"[{kind.__name__}: {str(error).splitlines()[0][:160]}]")  # fmt: skip


def agree(args, *datasets):
    """Before the first step: every rank must train the same run on the same data. A difference in the
    options that define the run, or in the data sets' sizes or fingerprints, ends every rank with the
    option (or data set) and the ranks that differ, instead of a collective mismatch deep in torch."""
    if not dist.is_initialized():
        return
    mine = {f"--{k.replace('_', '-')}": v for k, v in cli.defining(args).items()}
    mine.update({f"the {s.name} data ({len(s)} images here)": data.fingerprint(s) for s in datasets})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, value in everyone[0].items():
        differ = [f"rank {r}: {theirs.get(key)}" for r, theirs in enumerate(everyone) if theirs.get(key) != value]
        if differ:  # the same verdict on every rank; rank 0 says it
            stop(
                f"error: the ranks differ in {key}: rank 0: {value}, {', '.join(differ)}: give every rank the same options and data"
            )


def cleanup():
    """Stop the heartbeat, then leave. Rank 0 leaves last: its process serves the store (unless torchrun's
    agent does), and a heartbeat sent to a closed store prints a C++ stack trace after the run's summary."""
    if "beat" in _run:
        _run["stop"].set()
        _run.pop("beat").join()
        store, end = _run["store"], time.monotonic() + _run["timeout"]
        with contextlib.suppress(dist.DistError):
            store.add("left", 1)
            while _run["rank"] == 0 and store.add("left", 0) < _run["world_size"] and time.monotonic() < end:
                time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()


def stop(message):
    """End every rank, which all reached the same verdict; rank 0 alone says why."""
    raise SystemExit(message if not dist.is_initialized() or dist.get_rank() == 0 else 1)


def print0(*args):
    """Print from global rank 0 only; flush so batch logs show progress as it happens."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def banner(args, rank, local_rank, world_size, device):
    """The start of every log: what ran, where and how, so that two logs of a sweep tell themselves apart;
    then the rank <-> host <-> device map, the first thing to read when a job hangs."""
    cuda = torch.version.cuda if torch.cuda.is_available() else "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    print0(f"torch {torch.__version__} | CUDA {cuda} | NCCL {nccl} | device {device.type} | world size {world_size}")
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    print0(f"started {time.strftime('%Y-%m-%d %H:%M:%S')} | job {job} | loader {args.loader}, {data.num_workers(args)} "
           f"workers and {torch.get_num_threads()} OMP threads per rank | output {args.output_dir}")  # fmt: skip
    print0(f"options: {' '.join(sys.argv[1:]) or '(the defaults)'}")
    here = (rank, local_rank, os.environ.get("SLURMD_NODENAME", socket.gethostname()), str(device))  # Slurm's name
    everyone = [here] * world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, here)
    for r, lr, host, dev in everyone:
        print0(f"  rank {r} | local rank {lr} | host {host} | device {dev}")
