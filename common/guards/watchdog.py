"""Guard rail: no wait for other ranks outlasts --dist-timeout by more than a few seconds, and each says what it
waited for. setup() meets the others in the process group's store at MASTER_ADDR:MASTER_PORT (rank 0's, or
torchrun's agent's); rendezvous.check_rendezvous() looks at both before, and the watchdog is a second client of that
store, in a thread from before setup() to the run's end: it names the ranks that did not arrive, or says that the
process group did not form though all did; then each rank beats in it, so that a failed collective names the ranks
gone silent (killed, stopped, hung), not a timeout deep in the backend; a worker whose torchrun is gone ends."""

import os
import socket
import threading
import time

import torch.distributed as dist

from common.guards import arrival, rendezvous
from common.guards.waits import deadline, fail, within

HEARTBEAT = 1.0  # seconds between a rank's signs of life in the store
SILENT = (  # a rank's end that no line of its own explains
    "ended or stopped answering: its own error, if it had one, is above; else killed (a signal, a crash, the "
    "out-of-memory killer), stopped, hung or swapping"
)


class Watchdog:
    """This process's second client of the rendezvous store, its rank and heartbeat, from before setup() until the
    run ends. `phase`, how far the rendezvous got: "reach" (rank 0's store is not up yet), "connect", "arrive"
    (the ranks write their host), "form" (every rank came; the process group forms), "run"."""

    def __init__(self, launch, timeout):
        self.launch, self.rank, self.world_size, self.timeout = launch, launch.rank, launch.world_size, timeout
        self.where, self.phase = f"{launch.addr}:{launch.port}", "reach"
        self.agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
        self.serves = launch.rank == 0 and not self.agent
        self.store, self.served, self.beat, self.listeners = None, None, None, []
        self.stopping, self.ready, self.saying = threading.Event(), threading.Event(), threading.Lock()
        self.saving = threading.Event()  # a checkpoint's write until the next step (saving.Saving.writing())

    def watch(self):
        """Start the thread that meets the other ranks in the store setup() meets in next (arrival.py), and wait
        until all have arrived there: setup() then waits in torch for ranks that are all there. Rank 0 serves that
        store from now on."""
        end = time.monotonic() + self.timeout
        if self.serves:
            self.served = arrival.serve(self.launch, self.timeout)
        self.beat = threading.Thread(target=self.follow, args=(end,), daemon=True)
        self.beat.start()
        self.ready.wait()  # or the thread ends the process with its line (verdict())

    def follow(self, end):
        """The thread: connect to the store, arrive there (arrival.py), wait for every rank until `end` (else one
        line that ends the process: verdict()), then beat until leave()."""
        addr, port = self.launch.addr, self.launch.port
        while not rendezvous.reachable(addr, port):  # rank 0's store (check_rendezvous() waited on it)
            self.waited(end)
        self.phase = "connect"
        try:
            with deadline(end + 5 - time.monotonic(), self.verdict):
                client = arrival.client(self.launch, self.timeout)
        except dist.DistError:
            self.verdict()
        self.store, self.phase = arrival.space(client), "arrive"
        try:
            self.arrive(end)
        except dist.DistError:  # rank 0, which serves the store, ended: why() says so
            self.verdict()
        self.phase = "form"
        self.ready.set()
        self.heartbeat(time.monotonic() + self.timeout + 5)

    def arrive(self, end):
        """Arrive in the store, launched as the others were and the only one of this rank; wait for them all, or
        for a rank that failed first to say so."""
        store, rank = self.store, self.rank
        if said := arrival.launched(store, rank, self.world_size):
            self.say(said, tell=arrival.first_job(store) == arrival.who()[1])  # not into another job's store
        if said := arrival.duplicate(store, rank):
            self.say(said, tell=True)
        arrival.clear(store.underlying_store)  # an earlier attempt's addresses: before this rank arrives
        store.set(f"host/{rank}", socket.gethostname())
        store.add("arrived", 1)
        while store.add("arrived", 0) < self.world_size:
            if said := arrival.heard(store, rank, self.world_size):
                self.say(said)
            self.waited(end)

    def say(self, line, tell=False):
        """End the process with `line`, told to the others first where `tell`."""
        if tell:
            self.failed(line)
            within(2, lambda: self.store.add("failures", 1))
        if self.saying.acquire(blocking=False):
            if self.serves:  # the store ends with this process: first every rank that arrived reads why
                arrival.held(self.store, 10, self.world_size)
            fail(line)
        raise SystemExit

    def heartbeat(self, form_by):
        """Keep this rank's heartbeat in the store; end the rank if the process group has not formed by `form_by`
        though every rank arrived (they cannot reach each other's addresses), or once its torchrun is gone."""
        parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        beaten = 0
        while not self.stopping.is_set():
            if parent and os.getppid() != parent and not self.saving.is_set():  # a save in progress finishes first
                fail(f"error: rank {self.rank}: torchrun (pid {parent}) has ended: this worker ends too")
            if self.phase == "form" and dist.is_initialized():  # rank 0 holds its store (served) until leave()
                self.phase = "run"
            elif self.phase == "form" and time.monotonic() > form_by:
                self.verdict()
            if time.monotonic() - beaten >= HEARTBEAT:
                beaten = time.monotonic()
                try:
                    self.store.set(f"alive/{self.rank}", str(time.time()))
                    for listen in self.listeners:
                        listen(self.store)
                except dist.DistError:  # gone with rank 0 (the main thread says what failed), or with torchrun:
                    if not parent:  # its socket closes before this process gets a new parent, still watched
                        return
                    beaten = float("inf")  # no more beats
            self.stopping.wait(HEARTBEAT if self.phase == "run" else 0.05)

    def waited(self, end):
        """Between two looks at the rendezvous: the verdict past `end`; the thread ends with leave()."""
        if time.monotonic() > end or self.stopping.wait(0.1):
            self.verdict()

    def verdict(self):
        """From the watchdog's thread: end the process with why(), unless the main thread says it (unmet()) or the
        run ends (leave()): then this thread alone ends."""
        if not self.stopping.is_set() and self.saying.acquire(blocking=False):
            fail(self.why())
        raise SystemExit  # ends this thread, silently

    def why(self, error=None):
        """The line for a rendezvous that did not complete, as far as it got (`phase`); `error`, setup()'s."""
        rank, where, timeout, world_size = self.rank, self.where, self.timeout, self.world_size
        if self.phase == "reach":
            return (
                f"error: rank {rank}: its rendezvous store at {where} did not start within --dist-timeout {timeout} s"
            )
        if self.phase == "connect":
            return (
                f"error: rank {rank}: {where} accepts connections but is no rendezvous store: MASTER_PORT is "
                "taken by another program; choose another port"
            )
        missing = self.phase == "arrive" and within(
            5, lambda: [r for r in range(world_size) if not self.store.check([f"host/{r}"])]
        )
        if missing is None:
            return f"error: rank {rank}: lost the rendezvous store at {where}: rank 0 ended (its message says why)"
        if missing:
            return (
                f"error: rank {rank}: ranks {', '.join(map(str, missing))} of {world_size} did not arrive at "
                f"{where} within --dist-timeout {timeout} s: were they started (srun with --ntasks = world size, "
                "torchrun on every node), or killed before they could say why?"
            )
        return arrival.unformed(self.store, rank, world_size, error)

    def unmet(self, error):
        """setup()'s error, the process group not formed: the line the thread would say at its deadline."""
        self.saying.acquire()  # the thread says nothing more: one line
        if "EADDRINUSE" in str(error):  # rank 0's port, taken after check_rendezvous()
            return rendezvous.port_in_use(self.launch.port)
        return self.why(error)

    def listen(self, fn):
        """Call fn(store) with every heartbeat, in the heartbeat's thread, which leave() stops before the store
        closes (the preemption guard hears there of a stop another rank proposed)."""
        self.listeners.append(fn)

    def store_gone(self):
        """In words, why the store fails once the process that served it has ended."""
        return (
            f"the rendezvous store at {self.where} is gone: rank 0 (or torchrun), which served it, ended first "
            "(killed, out of memory; its own error, if it had one, is above)"
        )

    def failed(self, line):
        """This rank's own error, in the store: a failed collective on the others names it (explain()); returns
        `line`. Bounded: the store may be gone with rank 0."""
        within(2, lambda: self.store and self.store.set(f"failed/{self.rank}", line[:500]))
        return line

    def peers(self):
        """(store, rank, world size): the watchdog's client, for the guard rails that talk through the store, once
        every rank has arrived there (setup() returned: so have they, or nearly); None before watch()."""
        self.ready.wait(self.timeout + 5 if self.beat else 0)
        return (self.store, self.rank, self.world_size) if self.store else None

    def explain(self, error):
        """A failed collective, as one line naming the ranks that stopped answering; None for any other error."""
        # inside backward(), DDP's reducer turns a failed collective into a RuntimeError from the backend
        backend = isinstance(error, RuntimeError) and any(
            name in str(error) for name in ("gloo", "NCCL", "ProcessGroup")
        )
        if not (isinstance(error, dist.DistError) or backend):
            return None
        if self.phase != "run" and not dist.is_initialized():  # setup()'s rendezvous failed
            return self.unmet(error)
        if not self.store:
            return None
        rank, store, timeout = self.rank, self.store, self.timeout
        failed, stalled = [], []  # ranks that said why they ended; ranks silent, for no reason known

        def ask():  # in a thread: a store on a stopped rank 0 accepts connections and never answers
            time.sleep(3 * HEARTBEAT)  # a rank killed just now (SIGKILL, out of memory) has beaten a moment ago
            now = time.time()
            try:
                for r in range(self.world_size):
                    last = float(store.get(f"alive/{r}")) if store.check([f"alive/{r}"]) else 0
                    who = f"{r} ({store.get(f'host/{r}').decode()}"
                    if store.check([f"failed/{r}"]):  # it said why it ended: no guess
                        failed.append(f"rank {who}) failed: {store.get(f'failed/{r}').decode()[7:]}")
                    elif now - last > 3 * HEARTBEAT:
                        stalled.append(f"{who}, silent for {now - last:.0f} s)")
            except dist.DistError:  # the store ended with rank 0
                stalled.append(f"0 (the store at {self.where} is gone)")

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(5 + 3 * HEARTBEAT)
        if asking.is_alive():
            cause = f"rank 0, which holds the store at {self.where}, stopped answering"
        else:  # a rank that said why it ended is named with its reason; one that went silent, with the guesses
            silent = [f"rank {', rank '.join(stalled)} {SILENT}"] if stalled else []
            cause = "; ".join(failed + silent) or "every rank still answers: see the collective's error"
        return (
            f"error: rank {rank}: a collective failed within --dist-timeout {timeout} s: {cause} "
            f"[{type(error).__name__}: {str(error).splitlines()[0][:160]}]"
        )

    def leave(self, together=True):
        """Stop the heartbeat; where every rank ends `together` and this one serves the store (rank 0, unless
        torchrun's agent does), wait for all to leave: a heartbeat sent to a closed store prints a C++ stack trace
        after the summary. After a failure the others may never come: no wait."""
        if not self.beat:
            return
        self.stopping.set()
        self.beat.join(2 * HEARTBEAT)  # a thread still waiting in the rendezvous (a failure): left behind
        self.beat, store, end = None, self.store, time.monotonic() + self.timeout
        if store is None:  # it never connected: a failed rendezvous
            return
        try:
            store.add("left", 1)
            while together and self.serves and store.add("left", 0) < self.world_size and time.monotonic() < end:
                time.sleep(0.05)
        except dist.DistError:
            pass
        self.served = None  # rank 0: the store closes now
