"""Test-only fault injection, from outside the stages. With this folder on PYTHONPATH, Python imports this file
at start-up in every process, the launchers included; a variable touches only the processes it names, and
nothing is imported without one. The FAULT_ variables act on rank FAULT_RANK=r alone (RANK, or SLURM_PROCID in
an srun step); tests/test_inject.py fires each of them through its hook and keeps this table and the code equal.

variable           hook patched                           what it does
FAULT_STEP=n       torch.optim.Adadelta.step              raises at the n-th optimizer step (a crash on one rank)
FAULT_NAN=n        torch.optim.Adadelta.step              the weights turn NaN after the n-th step (a divergence)
FAULT_SLEEP=s      torch.optim.Adadelta.step              every optimizer step first sleeps s seconds (a slow node)
FAULT_FULL=n       torch.optim.Adadelta.step              after the n-th step, a file fills the disk of --output-dir
                                                          (another job filling a shared disk)
FAULT_ENOSPC=n     torch.save                             the n-th save fails half-way: "No space left on device"
FAULT_SAVE=n       torch.save                             the rank dies (SIGKILL) half-way through its n-th save
FAULT_SLOW_SAVE=s  torch.save                             every save first waits s seconds (a slow file system)
FAULT_SLOW=f       torch.mm                               matrix products take f times as long (a slow GPU or node)
FAULT_TORCH=v      torch.__version__                      torch says it is version v (another environment on a node)
RECORD_SAMPLES=p   DistributedSampler.__iter__            each sampler's epoch appends (rank, epoch, indices) to p
RECORD_BATCHES=p   common.data.Images.__getitem__         each batch an Images set builds appends (rank, set size,
                                                          indices) to p
NO_DROPOUT=1       torch.nn.Dropout.forward               dropout passes its input through: each rank draws its own
                                                          masks, so runs at two world sizes differ by sums' order alone
LATE_RELEASE=s     destroy_process_group                  rank 0's last collective ends in gloo's thread while rank 0
                                                          holds the GIL for s seconds after destroy_process_group (a
                                                          teardown that aborts)
NO_UNPICKLE=1      torch.load, pickle.load, pickle.loads  unpickling that may run what a file names raises, in a
                                                          stage's train.py only (torchrun's agent pickles its own
                                                          state); the ranks' object collectives are excepted: they
                                                          carry what rank 0 has already read
"""

import os
import sys

env = os.environ
rank = env.get("RANK", env.get("SLURM_PROCID") if "SLURM_STEP_ID" in env else "0")

if "FAULT_RANK" in env and rank == env["FAULT_RANK"]:
    import errno
    import io
    import signal
    import sys
    import time

    import torch

    calls = {"step": 0, "save": 0}
    step, save = torch.optim.Adadelta.step, torch.save

    def faulty_step(self, *args, **kwargs):
        calls["step"] += 1
        if calls["step"] == int(env.get("FAULT_STEP", 0)):
            raise RuntimeError(f"injected fault: rank {rank} at step {calls['step']}")
        time.sleep(float(env.get("FAULT_SLEEP", 0)))
        result = step(self, *args, **kwargs)
        if calls["step"] == int(env.get("FAULT_NAN", 0)):
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        if calls["step"] == int(env.get("FAULT_FULL", 0)):
            fill(sys.argv[sys.argv.index("--output-dir") + 1])
        return result

    def fill(folder):
        fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, bytes(2**16)):
                pass
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)

    def faulty_save(obj, f, *args, **kwargs):
        calls["save"] += 1
        time.sleep(float(env.get("FAULT_SLOW_SAVE", 0)))
        if calls["save"] not in (int(env.get("FAULT_SAVE", 0)), int(env.get("FAULT_ENOSPC", 0))):
            return save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        save(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if hasattr(f, "write"):
            f.write(half)
            f.flush()
        else:
            with open(f, "wb") as out:
                out.write(half)
        if calls["save"] == int(env.get("FAULT_ENOSPC", 0)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.kill(os.getpid(), signal.SIGKILL)

    torch.optim.Adadelta.step, torch.save = faulty_step, faulty_save

    if "FAULT_SLOW" in env:
        mm = torch.mm

        def slow_mm(*args, **kwargs):
            start = time.perf_counter()
            result = mm(*args, **kwargs)
            time.sleep((float(env["FAULT_SLOW"]) - 1) * (time.perf_counter() - start))
            return result

        torch.mm = slow_mm
    torch.__version__ = env.get("FAULT_TORCH", torch.__version__)

if "RECORD_SAMPLES" in env:
    import json

    from torch.utils.data import distributed

    iterate = distributed.DistributedSampler.__iter__

    def recording_iter(self):
        indices = list(iterate(self))
        with open(env["RECORD_SAMPLES"], "a") as f:
            f.write(json.dumps({"rank": self.rank, "epoch": self.epoch, "indices": indices}) + "\n")
        return iter(indices)

    distributed.DistributedSampler.__iter__ = recording_iter

if "RECORD_BATCHES" in env:
    import json

    from common import data

    build = data.Images.__getitem__

    def recording_getitem(self, indices):
        with open(env["RECORD_BATCHES"], "a") as f:
            f.write(json.dumps({"rank": rank, "size": len(self), "indices": list(map(int, indices))}) + "\n")
        return build(self, indices)

    data.Images.__getitem__ = recording_getitem

if "NO_DROPOUT" in env:
    from torch import nn

    nn.Dropout.forward = lambda self, x: x

if "LATE_RELEASE" in env:
    import atexit
    import sys
    import time

    import torch
    import torch.distributed as dist

    class Teardown:
        def __del__(self):  # the interpreter's teardown frees objects that let other threads run, as torch's do
            time.sleep(0.2)

    teardown, destroy, late = Teardown(), dist.destroy_process_group, {}

    def late_destroy(*args, **kwargs):
        late.update(group=dist.new_group(), first=dist.get_rank() == 0, size=dist.get_world_size())
        destroy(*args, **kwargs)

    def late_collective():
        """The last thing before the teardown (atexit runs the first registered last): a collective that ends
        late, in gloo's thread, holding the only reference to its output, a tensor with Python state, which
        that thread must take the GIL to free; this thread keeps the GIL into the teardown."""
        if not late:
            return
        outputs = [torch.zeros(1) for _ in range(late["size"])]
        for t in outputs:
            t.note = "Python state"
        late["group"].barrier().wait()
        sys.setswitchinterval(100)  # this thread keeps the GIL from now on
        if late["first"]:
            late["group"].allgather([outputs], [torch.ones(1)])
            del outputs
            end = time.perf_counter() + float(env["LATE_RELEASE"])
            while time.perf_counter() < end:  # the other ranks join 1 s late; gloo's thread then waits for the GIL
                pass
        else:
            time.sleep(1)
            late["group"].allgather([outputs], [torch.ones(1)]).wait()

    dist.destroy_process_group = late_destroy
    atexit.register(late_collective)

if "NO_UNPICKLE" in env and sys.argv[0].endswith("train.py"):
    import pickle

    import torch

    collective = torch.storage._load_from_bytes.__code__  # a tensor of an object collective: what rank 0 has read

    def refuse(what):
        frame = sys._getframe(2)
        while frame and frame.f_code is not collective:
            frame = frame.f_back
        if not frame:
            raise RuntimeError(f"injected check: {what} runs whatever the data names")

    load, pickle_load, pickle_loads = torch.load, pickle.load, pickle.loads

    def weights_only_load(*args, weights_only=None, **kwargs):
        if weights_only is False:
            refuse("torch.load(weights_only=False)")
        return load(*args, weights_only=weights_only, **kwargs)

    def unrestricted_load(*args, **kwargs):
        refuse("pickle.load")
        return pickle_load(*args, **kwargs)

    def unrestricted_loads(*args, **kwargs):
        refuse("pickle.loads")
        return pickle_loads(*args, **kwargs)

    torch.load, pickle.load, pickle.loads = weights_only_load, unrestricted_load, unrestricted_loads
