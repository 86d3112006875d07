"""Guard rail: bind only what can be bound. `torchrun --numa-binding=node` (torch >= 2.9) binds local rank i to the
CPUs of GPU i's NUMA node that the job may use, and stops the run at start ('Must bind to a non-empty set of CPU
indices') where it may use none of them: a job on part of a two-socket node, its CPUs on one socket and a GPU on
the other (1 task, 8 CPUs, --gres=gpu:2). torchrun has no fallback. Run as `python -m common.guards.numa` in a
torchrun job script, it prints the flag where every rank's CPUs meet its GPU's node, else nothing, and says once
why the ranks run unbound; nothing either where binding is not to be had (no numactl, no GPU, an older torch).
It decides on the node it runs on (the first; a job's nodes are alike). The doctor's NUMA line says the same."""

import os
import shutil
import sys
from pathlib import Path

FLAG = "--numa-binding=node"


def cpulist(text):
    """The CPUs of a sysfs cpulist ("0-3,8-11")."""
    ranges = [part.partition("-") for part in text.strip().split(",") if part]
    return {cpu for lo, _, hi in ranges for cpu in range(int(lo), int(hi or lo) + 1)}


def ranges(cpus):
    """{0, 1, 2, 5} as "0-2,5"."""
    runs, cpus = [], sorted(cpus)
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in runs)


def gpu_node(bus, sysfs=Path("/sys")):
    """(the NUMA node torch binds the GPU at PCI address `bus` to, that node's CPUs), as torch reads them from sysfs
    (-1, one node or firmware that does not say, is node 0); None where sysfs does not say, and torch would fail."""
    try:
        node = max(int((sysfs / "bus/pci/devices" / bus.lower() / "numa_node").read_text()), 0)
        return node, cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None


def unbindable(buses, allowed, sysfs=Path("/sys")):
    """Why torchrun's --numa-binding=node would stop the run, for the first local rank it cannot bind (its GPU at
    buses[rank], the job's CPUs `allowed`), or None where every rank's CPUs meet its GPU's node."""
    for rank, bus in enumerate(buses):
        found = gpu_node(bus, sysfs)
        if found is None:
            return f"sysfs gives no NUMA node for local rank {rank}'s GPU ({bus})"
        node, near = found
        if not near & allowed:
            return (
                f"local rank {rank}'s GPU ({bus}) sits on NUMA node {node} (CPUs {ranges(near)}), where the job "
                f"may use none of its CPUs ({ranges(allowed)})"
            )
    return None


def buses():
    """The PCI addresses, as sysfs names them, of the GPUs torch sees, in its order (local rank i uses GPU i); none
    where binding is not to be had: no numactl (torch binds through it), no GPU, a torchrun without the flag."""
    if not shutil.which("numactl"):
        return []
    import torch  # only now: where there is no numactl, the job script's call costs no torch import
    from torch.distributed import run

    if not torch.cuda.is_available():
        return []
    if "--numa-binding" not in run.get_args_parser()._option_string_actions:  # torch < 2.9
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0" for p in props]


def flag(found, allowed, sysfs=Path("/sys"), say=sys.stderr):
    """torchrun's binding flag for GPUs at PCI addresses `found` and the job's CPUs `allowed`, or "" (said once)."""
    if not found:
        return ""
    if why := unbindable(found, allowed, sysfs):
        print(f"NUMA: the ranks run unbound: {why} (torchrun {FLAG} would stop the run)", file=say)
        return ""
    return FLAG


if __name__ == "__main__":
    print(flag(buses(), os.sched_getaffinity(0)))
