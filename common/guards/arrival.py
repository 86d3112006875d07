"""Guard rail: the ranks meet in the rendezvous store before setup() does, so that no rank waits in torch for one
that will never come. Rank 0 starts the store setup() then meets in (torch takes it over: it is served once per
port and process); every rank then arrives there, in keys of its own (`watchdog/`, a prefix per attempt of a
torchrun restart), and none goes on to setup() before all have. There, before any wait of torch's:

  a rank that failed or was refused at start-up has said so (tell(): its line): the others end with one line
    naming it, instead of waiting out --dist-timeout for a rank that "did not arrive"
  every rank was launched alike (world size, job): a task of another launch, or of another job whose port this one
    shares, is named as such, and writes nothing into another job's store
  no two tasks claim one rank
  the keys an earlier attempt's process group left in torchrun's store (its ranks' addresses, gone with them) are
    deleted: a restart's ranks meet each other, not the previous attempt's ports."""

import datetime
import os
import re
import time

import torch.distributed as dist

from common.guards import rendezvous
from common.guards.ending import Refusal
from common.guards.waits import within

UNLIKE, ANOTHER = "here but", "another launch's"  # the words of launched()'s lines
PREFIX = "default_pg/"  # the keys of the process group setup() makes (its gloo or NCCL addresses)


def who(env=os.environ):
    """(the variable holding the world size, the launch's id) as this rank's launcher set them."""
    if "RANK" in env:  # torchrun
        return "WORLD_SIZE", env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "none"
    return "SLURM_NTASKS", env.get("SLURM_JOB_ID") or "none"


def serve(launch, timeout):
    """Rank 0's store, before setup(): held by the watchdog until every rank has left (leave())."""
    try:
        return dist.TCPStore(
            launch.addr,
            launch.port,
            launch.world_size,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except dist.DistError:  # taken since check_rendezvous() found it free, or its own client met another host
        raise Refusal(rendezvous.foreign(launch.addr) or rendezvous.port_in_use(launch.port)) from None


def client(launch, timeout):
    """A client of the store at the launch's address and port."""
    return dist.TCPStore(
        launch.addr, launch.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )


def space(client):
    """The watchdog's keys in the store, apart from the process group's; fresh for each restart in torchrun's
    agent's store, which outlives one attempt."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = f"/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}" if agent else ""
    return dist.PrefixStore(f"watchdog{attempt}", client)


def launched(store, rank, world_size):
    """The line for a rank launched unlike the first that arrived (another world size, another job), or None."""
    name, job = who()
    first = store.compare_set("launch", "", f"{world_size} {job} {rank}").decode().split(" ")
    if first[:2] == [str(world_size), job]:
        return None
    where = f"{store.underlying_store.host}:{store.underlying_store.port}" if hasattr(store, "underlying_store") else ""
    if first[1] != job:
        return (
            f"error: rank {rank}: the rendezvous store at {where} is {ANOTHER} (job {first[1]}; this is job "
            f"{job}): two jobs share MASTER_PORT on this node; set MASTER_PORT to a free port for one of them"
        )
    return (
        f"error: rank {rank}: {name} is {world_size} {UNLIKE} {first[0]} on rank {first[2]}, in one launch (job "
        f"{job}): every task must see the same; a task started by hand, or of another srun step, at {where}?"
    )


def duplicate(store, rank):
    """The line for a second task claiming `rank`, or None."""
    if store.add(f"rank/{rank}", 1) == 1:
        return None
    name = "RANK" if "RANK" in os.environ else "SLURM_PROCID"
    return f"error: rank {rank}: another task has {name} {rank} too: the launcher gives each task its own"


def heard(store, rank, world_size):
    """The line naming a rank that failed at start-up and said so in the store (tell()), or None."""
    if not store.add("failures", 0):
        return None
    for other in range(world_size):
        if store.check([f"failed/{other}"]):  # its own rank too: a second task that claimed it
            said = store.get(f"failed/{other}").decode().removeprefix("error: ").removeprefix(f"rank {other}: ")
            store.add("read", 1)
            return f"error: rank {rank}: rank {other} failed at start-up, before the ranks met: {said}"
    return None


def unformed(store, rank, world_size, error):
    """The line for a process group that did not form although every rank arrived: a rank gone silent since (it
    beats in the store from its arrival on), else the network only where torch tried an address it could not
    reach, else what torch said."""
    now, text = time.time(), str(error or "")
    silent = within(5, lambda: [r for r in range(world_size) if now - beaten(store, r) > 3]) if store else []
    head = f"error: rank {rank}: the process group did not form although every rank arrived"
    if silent is None:
        return f"{head}: rank 0, which holds the store, ended or stopped answering (its own error, if any, is above)"
    if silent:
        return (
            f"{head}: rank {', rank '.join(map(str, silent))} went silent since (stopped, killed or hung; its own "
            "error, if it had one, is above)"
        )
    unreachable = re.search(
        r"Connection refused|Connect(?:ion)? time(?:d )?out|No route to host|unreachable", text, re.IGNORECASE
    )
    address = re.search(r"(?:\[?\d{1,3}(?:\.\d{1,3}){3}\]?|\[[0-9a-fA-F:]+\]):\d+", text)
    if unreachable:
        return (
            f"{head}: {address[0] if address else 'a peer'} did not answer ({unreachable[0]}): the ranks cannot reach "
            "each other's addresses; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the network the nodes share"
        )
    said = " ".join(text.split())[:200] or "no error within --dist-timeout, every rank still answering"
    return f"{head}: {said}"


def beaten(store, rank):
    """When `rank` last beat in the store (watchdog.heartbeat()); 0 if never."""
    return float(store.get(f"alive/{rank}")) if store.check([f"alive/{rank}"]) else 0


def clear(store):
    """Delete the process group's keys an earlier attempt left in torchrun's store, before this one arrives."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and hasattr(store, "list_keys"):
        for key in store.list_keys():
            if key.startswith(PREFIX):
                store.delete_key(key)


def tell(launch, timeout, line, alone):
    """A rank that failed before it arrived: its line in the store, that the others name it; bounded, as rank 0's
    store may never start (rank 0 failed too). Rank 0, which would serve it, starts it and keeps it a few seconds
    for the others to read; a second task of rank 0 leaves the port to the first, and tells it in its store.
    Returns the line this rank says: a launch unlike the others' (its cause), or, where `alone` (a verdict rank 0
    says for all), its line unless rank 0 says the same."""
    if not launch.addr or not line:
        return None
    served, second = None, rendezvous.TWO_RANK_0 in line  # the other rank 0 serves the store: tell it there
    if launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and not second:
        served = within(2, lambda: serve(launch, timeout))
        if served is None and rendezvous.holder(launch.port) != who()[1]:  # another's port: no store to tell in
            return own(line, launch.rank) if alone else None
    elif not wait_reachable(launch, min(timeout, 10)):
        return own(line, launch.rank) if alone else None

    def say():
        store = space(client(launch, 5))
        unlike = launched(store, launch.rank, launch.world_size)
        if unlike and who()[1] != first_job(store):
            return unlike  # another job's store: nothing of ours in it
        store.set(f"failed/{launch.rank}", (unlike or line)[:500])  # the launch that differs is the cause
        store.add("failures", 1)
        if unlike or not alone:
            return unlike
        store.add("asking", 1)  # rank 0 keeps its store until this rank has read its line: settled()
        end = time.monotonic() + 3  # rank 0 met the same verdict, and says it for all?
        try:
            while not store.check(["failed/0"]) and time.monotonic() < end:
                time.sleep(0.1)
            said = store.get("failed/0").decode() if store.check(["failed/0"]) else ""
            store.add("asking", -1)
        except dist.DistError:  # rank 0 ended (its own verdict) before this rank read it: no one said this line
            return line
        # rank 0 arrived after this rank and found its launch unlike this one's: that is the cause, not the verdict
        return None if said == line[:500] else unlike_of(said, 0, launch.rank) or line

    said = within(8, say)
    if served is not None:
        end = time.monotonic() + min(timeout, 10)
        while time.monotonic() < end and (within(1, lambda: heeded(served)) or 0) < launch.world_size - 1:
            time.sleep(0.1)
        said = said or within(2, lambda: unlike_peer(space(served), launch.world_size))
    return own(said, launch.rank) if said else None


def unlike_peer(store, world_size):
    """Rank 0's line where another rank found its launch unlike rank 0's (launched()), or None."""
    for other in range(1, world_size):
        said = store.get(f"failed/{other}").decode() if store.check([f"failed/{other}"]) else ""
        if said := unlike_of(said, other, 0):
            return said
    return None


def unlike_of(said, other, rank):
    """`rank`'s line where rank `other` said (`said`) that its launch is unlike this one's, or None."""
    if UNLIKE in said or ANOTHER in said:
        return f"error: rank {rank}: its launch differs from rank {other}'s: {said.removeprefix('error: ')}"
    return None


def own(line, rank):
    """`line` as this rank's."""
    return line if line.startswith("error: rank ") else line.replace("error: ", f"error: rank {rank}: ", 1)


def held(store, seconds, world_size):
    """Rank 0, about to end with the store it serves: wait, at most `seconds`, until every rank has read the failure
    that ends it (heard()) or told its own: one that arrives later finds the store and the line, not nothing that
    answers until --dist-timeout (a second task of rank 0, refused by the folder this one holds, told it first)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and within(1, lambda: settled(store) < world_size):
        time.sleep(0.1)


def heeded(served):
    """How many other ranks read rank 0's failure, or failed at start-up themselves."""
    return settled(space(served)) - 1


def settled(store):
    """How many ranks read the failure that ends rank 0 (heard()) or told their own, less those that told one rank 0
    may say for all and still wait to read whether it does (tell()): the store must outlive their read."""
    return store.add("read", 0) + store.add("failures", 0) - store.add("asking", 0)


def first_job(store):
    return store.get("launch").decode().split(" ")[1]


def wait_reachable(launch, seconds):
    """Whether rank 0's store answers within `seconds`: at once not where its address does not resolve."""
    end = time.monotonic() + seconds
    while not rendezvous.reachable(launch.addr, launch.port):
        if time.monotonic() > end or not rendezvous.resolves(launch.addr):
            return False
        time.sleep(0.2)
    return True
