"""The rendezvous a learner reads is the one that runs: setup() meets the other ranks at tcp://MASTER_ADDR:
MASTER_PORT itself, and the guard rails watch it from outside, as a second client of the same store."""

import ast
import inspect
import subprocess
import sys

import pytest
import torch.distributed as dist
from helpers import HANG, REPO, STAGES, clean_env, free_port

from common import distributed
from common.environment import Launch
from common.guards import watchdog as watchdogs
from common.guards.watchdog import Watchdog

ONE_RANK = """
import os, socket, time
from types import SimpleNamespace
import torch.distributed as dist
from common import distributed
from common.guards import rails, rendezvous

port = int(os.environ["MASTER_PORT"])
args = SimpleNamespace(no_cuda=True, batch_size=64, sync_bn=False, compile=False, dist_timeout=10)
guard = rails.Guard()
guard.meet(args)
distributed.setup(args)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
watchdog = guard.watchdog.peers()[0]
print("store", type(store).__name__, store.port, store is not watchdog)
print("watchdog's key", store.get("watchdog/host/0").decode() == socket.gethostname())
del store  # the test's own reference would keep the store open
until = time.monotonic() + 10
while guard.watchdog.phase != "run" and time.monotonic() < until:
    time.sleep(0.05)
distributed.cleanup()
print("after cleanup", rendezvous.reachable("127.0.0.1", port))
guard.close(True)
print("after close", rendezvous.reachable("127.0.0.1", port))
"""


def test_setup_makes_the_rendezvous_it_shows():
    """setup() takes no store from the guard rails: its init_process_group meets at the launcher's address and
    port. Every stage (and the doctor) starts the guard rails on a line of its own, then calls setup(args)."""
    assert list(inspect.signature(distributed.setup).parameters) == ["args"]
    assert 'init_method=f"tcp://{launch.addr}:{launch.port}"' in inspect.getsource(distributed.setup)
    for path in [*(REPO / stage / "train.py" for stage in STAGES), REPO / "tools" / "doctor.py"]:
        tree = ast.parse(path.read_text())
        calls = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        alone = [ast.unparse(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)]
        guard = "guard.meet(args)" if path.parent.name == "tools" else "guard.start(args)"
        assert [c for c in calls if c.startswith(("distributed.setup(", "guard.start(", "guard.meet("))] == [
            guard, "distributed.setup(args)"], path  # fmt: skip
        assert guard in alone, path  # nothing returned to hand on


def test_the_process_group_meets_in_the_store_the_watchdog_watches():
    """One rank with a launcher's variables: the process group's store is a TCPStore at MASTER_PORT, where the
    watchdog's own client wrote this rank's host; rank 0 keeps it open past the process group's end (the others'
    heartbeats would hit a closed store after the summary: a C++ stack trace) until every rank has left."""
    port = free_port()
    env = clean_env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    out = subprocess.run([sys.executable, "-c", ONE_RANK], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=HANG)  # fmt: skip
    assert out.returncode == 0 and out.stdout.splitlines() == [
        f"store TCPStore {port} True", "watchdog's key True", "after cleanup True", "after close False"
    ], out.stdout + out.stderr  # fmt: skip
    assert out.stderr == ""


EADDRINUSE = "The server socket has failed to listen on any local network address. port: 29999, code: -98, name: EADDRINUSE"  # fmt: skip


@pytest.mark.parametrize("phase, error, said", [
    ("connect", dist.DistStoreError("wait timeout"), "rank 1: 127.0.0.1:29999 accepts connections but is no rendezvous store"),
    ("form", RuntimeError("[gloo/transport/tcp/pair.cc:144] Connect timeout"), "rank 1: the process group did not form although every rank arrived"),
    ("reach", dist.DistNetworkError(EADDRINUSE), "error: MASTER_PORT 29999 is in use"),
])  # fmt: skip
def test_a_rendezvous_that_fails_inside_setup_is_the_watchdogs_line(phase, error, said):
    """torch's own error from setup() before the process group formed (its timeouts and the watchdog's end
    together) is the line the watchdog says for how far the rendezvous got, and its thread says no second one."""
    watchdog = Watchdog(Launch(1, 1, 2, "127.0.0.1", 29999), 3)
    watchdog.phase = phase
    assert said in watchdog.explain(error)
    assert watchdog.saying.locked()


def test_a_worker_still_watches_its_torchrun_when_a_beat_finds_the_agents_store_gone(monkeypatch):
    """A killed torchrun's store socket closes before its workers get a new parent: a beat that fails in between
    (the store is torchrun's) leaves the parent watched, so the worker still ends in one line, not trains on."""
    said = []

    def fail(message):
        said.append(message)
        raise SystemExit

    class Gone:
        def set(self, key, value):
            raise dist.DistNetworkError("Connection reset by peer")

    parents = iter([4321, 4321])  # torchrun's pid when the beat starts and at its first look; then init's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setattr(watchdogs.os, "getppid", lambda: next(parents, 1))
    monkeypatch.setattr(watchdogs, "fail", fail)
    watchdog = Watchdog(Launch(1, 1, 2, "127.0.0.1", 29999), 3)
    watchdog.store, watchdog.phase = Gone(), "run"
    with pytest.raises(SystemExit):
        watchdog.heartbeat(form_by=0)
    assert said == ["error: rank 1: torchrun (pid 4321) has ended: this worker ends too"]
