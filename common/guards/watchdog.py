"""Guard rail: no wait for other ranks outlasts --dist-timeout by more than a few seconds, and each one
says what it waited for. The rendezvous names the address, the port and the ranks that did not arrive;
while the run lasts, every rank keeps a heartbeat in the rendezvous store, so that a failed collective
names the ranks that went silent (killed, stopped, hung) instead of a timeout deep in the backend; a
worker whose torchrun is gone ends too."""

import datetime
import ipaddress
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

HEARTBEAT = 1.0  # seconds between a rank's signs of life in the store


class deadline:
    """`with deadline(seconds, rank, why):` ends the process with `why` if the block is still running by
    then: for waits that take no timeout of their own, or ignore it (a TCP connection to a program that
    accepts it but never answers)."""

    def __init__(self, seconds, rank, why):
        self.timer = threading.Timer(seconds, lambda: fail(f"error: rank {rank}: {why}"))
        self.timer.daemon = True

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def fail(message):
    """Print and end this process now, from any thread: a rank stuck in C++ cannot be stopped politely."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def reachable(addr, port):
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return True
    except OSError:
        return False


def arrive(store, launch, where, end, timeout):
    """Wait until every rank has written its host into the store, naming the ones that have not by `end`."""
    rank, world_size = launch.rank, launch.world_size
    try:
        store.set(f"host/{rank}", socket.gethostname())
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
    except dist.DistError:
        raise SystemExit(
            f"error: rank {rank}: lost the rendezvous store at {where}: rank 0 ended (its message says why)"
        ) from None


class Watchdog:
    """This process's rendezvous store, rank and heartbeat: made before the process group, kept until the run
    ends."""

    def __init__(self):
        self.store, self.beat, self.listeners, self.stopping = None, None, [], threading.Event()

    def rendezvous(self, launch, timeout):
        """Meet the other ranks in a key-value store at rank 0's address and port (torchrun's own store under
        torchrun), each step bounded by `timeout` and, if it fails, named: returns the store for the process
        group."""
        rank, world_size, where, host = (
            launch.rank,
            launch.world_size,
            f"{launch.addr}:{launch.port}",
            socket.gethostname(),
        )
        try:
            ip = socket.getaddrinfo(launch.addr, launch.port, type=socket.SOCK_STREAM)[0][4][0]
        except socket.gaierror as err:
            raise SystemExit(f"error: MASTER_ADDR {launch.addr} does not resolve on {host} ({err.strerror}): set it to "
                             "rank 0's host name or address") from None  # fmt: skip
        # an srun task off the first node, rank 0's, that finds a loopback address would wait for itself
        # (under torchrun, torchrun sets MASTER_ADDR)
        off_first = os.environ.get("SLURM_NODEID", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
        if off_first and ipaddress.ip_address(ip).is_loopback:
            raise SystemExit(
                f"error: rank {rank} on {host}: MASTER_ADDR {launch.addr} is {ip}, a loopback address, but rank 0 runs "
                "on another node: unset MASTER_ADDR (srun tasks find the first node) or set it to rank 0's host name"
            )
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
        serve = self.serves = rank == 0 and not agent
        end = time.monotonic() + timeout
        if not serve:  # wait for the server in Python: torch's client retries silently past its timeout
            while not reachable(launch.addr, launch.port):
                if time.monotonic() > end:
                    raise SystemExit(
                        f"error: rank {rank} on {host}: nothing answers at {where} after --dist-timeout {timeout} s: "
                        "rank 0 did not start or failed first (did you launch with srun or torchrun?), or the address "
                        "is not rank 0's host"
                    )
                time.sleep(0.2)
        try:
            with deadline(timeout + 5, rank, f"{where} accepts connections but is no rendezvous store: MASTER_PORT is "
                          "taken by another program; choose another port"):  # fmt: skip
                store = dist.TCPStore(launch.addr, launch.port, world_size, is_master=serve, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        except dist.DistNetworkError as err:
            if "EADDRINUSE" in str(err):
                raise SystemExit(
                    f"error: MASTER_PORT {launch.port} is in use on {host} by another program: choose another port"
                ) from None
            raise SystemExit(
                f"error: rank {rank} could not reach the rendezvous store at {where}: {str(err).splitlines()[0]}"
            ) from None
        if (
            agent
        ):  # torchrun's own store outlives a restart: fresh keys for each (torch's own keys are kept apart alike)
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
        arrive(store, launch, where, end, timeout)
        self.store, self.where, self.rank, self.world_size, self.timeout = store, where, rank, world_size, timeout
        return dist.PrefixStore("pg", store)  # the process group's keys apart from the heartbeats

    def watch(self):
        """After rendezvous(): a thread that keeps this rank's heartbeat in the store, ends the rank if the process
        group has not formed within the timeout although every rank arrived (the ranks cannot reach each other's
        addresses), and when the torchrun that started it is gone (a killed launcher must not leave its workers
        running)."""
        store, rank, form_by = self.store, self.rank, time.monotonic() + self.timeout + 5
        parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        formed = False

        def beat():
            nonlocal formed
            while not self.stopping.is_set():
                if parent and os.getppid() != parent:
                    fail(f"error: rank {rank}: torchrun (pid {parent}) has ended: this worker ends too")
                formed = formed or dist.is_initialized()
                if not formed and time.monotonic() > form_by:
                    fail(f"error: rank {rank}: the process group did not form although every rank arrived: the ranks "
                         "cannot reach each other's addresses; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the "
                         "network the nodes share")  # fmt: skip
                try:
                    store.set(f"alive/{rank}", str(time.time()))
                    for listen in self.listeners:
                        listen(store)
                except dist.DistError:  # the store went with rank 0: the main thread reports what failed
                    return
                self.stopping.wait(HEARTBEAT)

        self.beat = threading.Thread(target=beat, daemon=True)
        self.beat.start()

    def listen(self, fn):
        """Call fn(store) with every heartbeat, in the heartbeat's thread, which leave() stops before the store
        closes (the preemption guard hears there of a stop another rank proposed)."""
        self.listeners.append(fn)

    def store_gone(self):
        """In words, why the store fails once the process that served it has ended."""
        return (f"the rendezvous store at {self.where} is gone: rank 0 (or torchrun), which served it, ended first "
                "(killed, out of memory; its own error, if it had one, is above)")  # fmt: skip

    def failed(self, line):
        """This rank's own error, in the store: a failed collective on the others names it (explain()); returns
        `line`. Bounded: the store may be gone with rank 0."""
        saying = threading.Thread(target=lambda: self.store and self.store.set(f"failed/{self.rank}", line[:500]))
        saying.daemon = True
        saying.start()
        saying.join(2)
        return line

    def peers(self):
        """(store, rank, world size) of this process's process group, for the guard rails that talk through the
        store; None before rendezvous()."""
        return (self.store, self.rank, self.world_size) if self.store else None

    def explain(self, error):
        """A failed collective, as one line naming the ranks that stopped answering; None for any other error."""
        # inside backward(), DDP's reducer turns a failed collective into a RuntimeError from the backend
        backend = isinstance(error, RuntimeError) and any(
            name in str(error) for name in ("gloo", "NCCL", "ProcessGroup")
        )
        if not self.store or not (isinstance(error, dist.DistError) or backend):
            return None
        rank, store, timeout = self.rank, self.store, self.timeout
        stalled = []

        def ask():  # in a thread: a store on a stopped rank 0 accepts connections and never answers
            time.sleep(3 * HEARTBEAT)  # a rank killed just now (SIGKILL, out of memory) has beaten a moment ago
            now = time.time()
            try:
                for r in range(self.world_size):
                    last = float(store.get(f"alive/{r}")) if store.check([f"alive/{r}"]) else 0
                    if store.check([f"failed/{r}"]):  # it said why it ended: no guess
                        stalled.append(f"{r} ({store.get(f'host/{r}').decode()}) failed: {store.get(f'failed/{r}').decode()[7:]}")  # fmt: skip
                    elif now - last > 3 * HEARTBEAT:
                        stalled.append(f"{r} ({store.get(f'host/{r}').decode()}, silent for {now - last:.0f} s)")
            except dist.DistError:  # the store ended with rank 0
                stalled.append(f"0 (the store at {self.where} is gone)")

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(5 + 3 * HEARTBEAT)
        if asking.is_alive():
            cause = f"rank 0, which holds the store at {self.where}, stopped answering"
        elif stalled:
            cause = (f"rank {', rank '.join(stalled)} ended or stopped answering: its own error, if it had one, is "
                     "above; else killed (a signal, a crash, the out-of-memory killer), stopped, hung or swapping")  # fmt: skip
        else:
            cause = "every rank still answers: see the collective's error"
        return (f"error: rank {rank}: a collective failed within --dist-timeout {timeout} s: {cause} "
                f"[{type(error).__name__}: {str(error).splitlines()[0][:160]}]")  # fmt: skip

    def leave(self, together=True):
        """Stop the heartbeat, then, where every rank ends `together`, wait for all to leave if this one serves the
        store (rank 0, unless torchrun's agent does): a heartbeat sent to a closed store prints a C++ stack trace
        after the summary. After a failure the others may never come: no wait."""
        if not self.beat:
            return
        self.stopping.set()
        self.beat.join()
        self.beat = None
        store, end = self.store, time.monotonic() + self.timeout
        try:
            store.add("left", 1)
            while together and self.serves and store.add("left", 0) < self.world_size and time.monotonic() < end:
                time.sleep(0.05)
        except dist.DistError:
            pass
