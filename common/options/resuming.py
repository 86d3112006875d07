"""--resume, and a run Slurm requeued or torchrun restarted (checkpoint.latest() chose the
checkpoint): restore() loads it, rank 0 reading it and handing it to every rank, so that only rank
0's node needs it; restore_sharded() (stage 05) has each rank read the pieces of its own shards,
at any world size (the checkpoint records where each lies). A checkpoint the guard rails saved
part-way through an epoch (a signal, --checkpoint-minutes) resumes at its sample: Resumable skips
what the epoch trained, and the random generators are put back as they were, so the resumed run
trains on the samples, drawn alike, that the uninterrupted run would have.
"""

import itertools
import math

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from common import shards
from common.checkpoint import SPLIT, unwrap
from common.environment import is_rank0
from common.metrics import Sums


def read_on_rank0(path):
    """read(path) on rank 0, handed to every rank."""
    box = [read(path) if is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    return box[0]


def read(path):
    """The checkpoint.pt at `path`, or a stage 05 folder's state.pt and "folder": the shards'."""
    folder = path.resolve() if path.is_dir() else None
    state = torch.load(folder / "state.pt" if folder else path, "cpu", weights_only=True)
    return state | {"folder": folder} if isinstance(state, dict) else state


def restore(path, states, sampler):
    """Load the checkpoint at `path` into `states`: returns the epoch to start with, the next after
    a whole one, the same after part of one, which `sampler` (Resumable) then starts part-way."""
    state = read_on_rank0(path)
    unwrap(states["model"]).load_state_dict(state["model"])
    states["optimizer"].load_state_dict(state["optimizer"])
    return restore_rest(state, states, sampler)


def restore_rest(state, states, sampler):
    """Everything but the model and the optimizer: the random generators (the guard rails' "rng")
    among them."""
    for name, thing in states.items():
        if name == "log":  # metrics.Log: a resume alone loads rows into one
            rewrite(thing, state[name]["rows"])
        elif name not in SPLIT and name in state:  # the guard rails' "run": none in an older one
            thing.load_state_dict(state[name])
    if state["step"]:  # saved part-way: the epoch's time and each rank's sums go on from its cut
        states["log"].carried[state["epoch"]] = carried(state["log"]["cut"], states["model"])
        states["log"].compiled = state["log"]["cut"].get("compiled", 0)  # --compile's, in it
    sampler.resume_at(state["epoch"], state["step"])
    return state["epoch"] if state["step"] else state["epoch"] + 1


def rewrite(log, rows):
    """The log's rows as the checkpoint holds them, metrics.csv rewritten: an epoch logged, not
    saved, counts once."""
    log.rows = list(rows)
    log.write()


def carried(cut, model):
    """(seconds, this rank's training Sums) of an epoch before a stop part-way; resumed at another
    world size (stage 05), rank 0 carries them all."""
    ranks, rank = cut["ranks"], dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if len(ranks) != world_size:
        ranks = [cut["training"]] + [dict.fromkeys(cut["training"], 0.0)] * rank
    device = next(model.parameters()).device
    return cut["seconds"], Sums(
        **{k: torch.tensor(v, device=device) for k, v in ranks[rank].items()}
    )


def restore_sharded(path, states, sampler):
    """Stage 05's restore(): each rank reads from the folder the pieces of its own shards (at any
    world size: the checkpoint records where each lies), or its shards of a whole checkpoint.pt."""
    state = read_on_rank0(path)
    load_sharded(state, states["model"], states["optimizer"])
    if state.get("buffers"):  # saved mid-epoch: each rank's own statistics
        set_buffers(states["model"], state["buffers"])
    return restore_rest(state, states, sampler)


def load_sharded(state, model, optimizer):
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    folder = state["folder"]
    if folder:  # the shapes to fill are this rank's shards
        weights, optimizer_state = sd.get_state_dict(model, optimizer)
        pieces = {"model": weights, "optimizer": optimizer_state["state"]}
        # DCP's own reader unpickles .metadata as it is: shards.reader() builds DCP's classes alone
        dcp.load(pieces, checkpoint_id=folder, storage_reader=shards.reader(folder))
        optimizer_state = {"state": pieces["optimizer"], "param_groups": state["param_groups"]}
        sd.set_state_dict(
            model, optimizer, model_state_dict=pieces["model"], optim_state_dict=optimizer_state
        )
        return
    # a whole checkpoint: optimizer.state_dict() numbers the parameters in this order
    names = [name for name, _ in model.named_parameters()]
    saved = state["optimizer"]
    groups = [g | {"params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
    by_name = {"state": {names[i]: v for i, v in saved["state"].items()}, "param_groups": groups}
    sd.set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=by_name,
        options=sd.StateDictOptions(full_state_dict=True),
    )


def set_buffers(model, saved):
    """This rank's own buffers as saved; at another world size, the mean of every rank's."""
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved[0]:
                own = [ranks_own[name] for ranks_own in saved]
                buffer.copy_(own[rank] if len(own) == ranks else sum(own) / len(own))


class Resumable(Sampler):
    """`sampler` (common/sampling.py Shuffled, or a DistributedSampler), its epochs able to start
    part-way: resume_at(epoch, steps) skips that epoch's first steps x `batch_size` (the global
    batch) samples, over all ranks. A DistributedSampler deals rank r every world_size-th sample of
    one order, so those seen are its first at any world size: resumed at another, the rest is dealt
    anew, none skipped or twice."""

    def __init__(self, sampler, batch_size):
        self.sampler, self.batch_size, self.skip = sampler, batch_size, (0, 0)

    @property
    def epoch(self):
        return self.sampler.epoch

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def resume_at(self, epoch, steps):
        self.skip = (epoch, steps * self.batch_size)

    def skipped(self):
        """The samples of this epoch that an earlier run trained on, over all ranks."""
        return self.skip[1] if self.skip[0] == self.epoch else 0

    def __len__(self):
        if isinstance(self.sampler, DistributedSampler):
            rest = len(self.sampler.dataset) - self.skipped()
            return max(0, math.ceil(rest / self.sampler.num_replicas))
        return max(0, len(self.sampler) - self.skipped())

    def __iter__(self):
        skip, sampler = self.skipped(), self.sampler
        if not skip:
            yield from sampler
        elif isinstance(sampler, DistributedSampler):  # the epoch's whole order, then deal the rest
            whole = DistributedSampler(sampler.dataset, 1, 0, sampler.shuffle, sampler.seed)
            whole.set_epoch(self.epoch)
            order = list(whole)
            rest = order[skip:]  # padded as DistributedSampler pads: with the order's first samples
            rest += itertools.islice(itertools.cycle(order), -len(rest) % sampler.num_replicas)
            yield from rest[sampler.rank :: sampler.num_replicas]
        else:
            yield from list(sampler)[skip:]
