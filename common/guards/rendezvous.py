"""Guard rail: the address and port where setup() meets the other ranks, checked before it does
(check_rendezvous()): one line naming the fix, instead of a wait that ends in a timeout or never."""

import errno
import functools
import ipaddress
import os
import re
import socket
import time

from common.guards.ending import Refusal

TWO_RANK_0 = "two tasks claim rank 0"  # the line of a second task of rank 0 (here, and lock.py's)


def check_rendezvous(launch, timeout):
    """Before setup() meets the others at MASTER_ADDR:MASTER_PORT: the address resolves and, off the first node,
    is not a loopback one; the port is free where rank 0 will serve the store, and answers, within `timeout`,
    where another rank waits for it (torch's client would retry silently past its timeout)."""
    host, where = socket.gethostname(), f"{launch.addr}:{launch.port}"
    if re.fullmatch(r"[^:]+:\d+", launch.addr):  # a port written into the address
        raise Refusal(
            f"error: MASTER_ADDR {launch.addr} holds a port: set MASTER_ADDR to the host alone and MASTER_PORT to "
            "the port"
        )
    if ":" in launch.addr:  # torch reads tcp://::1:29500 as a port "1:29500" ("Port could not be cast")
        raise Refusal(
            f"error: MASTER_ADDR {launch.addr} is an IPv6 address, which setup()'s tcp:// address cannot hold: "
            "set it to rank 0's host name (localhost for ::1) or its IPv4 address"
        )
    try:
        ip = socket.getaddrinfo(launch.addr, launch.port, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as err:
        addr = launch.addr if launch.addr.strip() == launch.addr else repr(launch.addr)  # a blank shown
        raise Refusal(
            f"error: MASTER_ADDR {addr} does not resolve on {host} ({err.strerror}): set it to "
            "rank 0's host name or address"
        ) from None
    # an srun task off the first node, rank 0's, that finds a loopback address would wait for itself (under
    # torchrun, torchrun sets MASTER_ADDR)
    off_first = os.environ.get("SLURM_NODEID", "0") != "0" and "TORCHELASTIC_RUN_ID" not in os.environ
    if off_first and ipaddress.ip_address(ip).is_loopback:
        raise Refusal(
            f"error: rank {launch.rank} on {host}: MASTER_ADDR {launch.addr} is {ip}, a loopback address, "
            "but rank 0 runs on another node: unset MASTER_ADDR (srun tasks find the first node) or set "
            "it to rank 0's host name"
        )
    if launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # rank 0 serves the store
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's: a port in TIME_WAIT is free
            try:
                probe.bind(("", launch.port))
            except OSError as err:
                raise Refusal(
                    port_in_use(launch.port)
                    if err.errno == errno.EADDRINUSE
                    else f"error: MASTER_PORT {launch.port}: {err.strerror}: choose another port"
                ) from None
        return
    end = time.monotonic() + timeout
    while not reachable(launch.addr, launch.port):
        if time.monotonic() > end:
            job = os.environ.get("SLURM_JOB_ID") if "MASTER_PORT" not in os.environ else None
            raise Refusal(
                f"error: rank {launch.rank} on {host}: nothing answers at {where} after --dist-timeout "
                f"{timeout} s: rank 0 did not start or failed first (did you launch with srun or "
                "torchrun?), or the address is not rank 0's host"
                + (f", or rank 0 has another SLURM_JOB_ID than {job}, whose port this is" if job else "")
            )
        time.sleep(0.2)


def reachable(addr, port):
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return True
    except OSError:
        return False


def resolves(addr):
    try:
        return bool(socket.getaddrinfo(addr, None))
    except socket.gaierror:
        return False


def foreign(addr):
    """Rank 0's line where its store could not start because MASTER_ADDR is no address of this host (its own client
    met another host, or none), else None: only then, as an address the host cannot bind may still reach it (NAT)."""
    family, *_, (ip, *_) = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family) as probe:
        try:
            probe.bind((ip, 0))
        except OSError as err:
            return (
                f"error: rank 0 on {socket.gethostname()}: MASTER_ADDR {addr} is {ip}, not an address of this host "
                f"({err.strerror}): set it to rank 0's host name or address"
            )
    return None


def port_in_use(port):
    """The line for rank 0's port, taken: by another job's rendezvous store (its job named), or another program."""
    job, mine = holder(port), os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    if job == mine:  # this job's own store: a second task that claims rank 0
        return f"error: MASTER_PORT {port} on {socket.gethostname()} is served by this job's rank 0: {TWO_RANK_0}"
    by = f"Slurm job {job}'s rendezvous store (job ids 40000 apart share a port)" if job else "another program"
    return f"error: MASTER_PORT {port} is in use on {socket.gethostname()} by {by}: choose another port (MASTER_PORT)"


@functools.cache  # asked again by arrival.tell(): the answer of a few seconds before
def holder(port):
    """The job whose rendezvous store serves `port` on this host (arrival.launched()'s key), or None."""
    import datetime

    import torch.distributed as dist

    from common.guards.waits import within

    def ask():
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=2)
        )
        return client.get("watchdog/launch").decode().split(" ")[1] if client.check(["watchdog/launch"]) else None

    return within(4, ask)
