"""Stage 05 builds the model on the meta device: shapes and dtypes, no memory, so that no rank ever
holds the whole model; after fully_shard, materialise() has each rank fill only its own shards,
with the values stage 01 starts from at the same seed: the same run at any world size. A task's
weights(args) file then replaces what it holds, as in every stage (common/options/hooks.py).
"""

import itertools

import torch
from torch import nn


def materialise(model, device, task):
    """Stage 05's model, built on the meta device and sharded: each rank fills its shards, a layer
    whole at most, as stage 01 starts at the seed."""
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return model.to(device)
    if len(dict(model.named_parameters())) < len([*model.named_parameters(remove_duplicate=False)]):
        raise TypeError("tied weights do not survive the meta device: set META = False in the task")
    model.to_empty(device=device)
    done, init = set(), getattr(task, "init_weights", None) or getattr(model, "init_weights", None)
    for m in [m for m in post_order(model, set()) if reset_of(m) and list(held(m, True))]:
        on_cpu(m, reset_of(m), done, recurse=True)  # those with tensors, children first
    for m in post_order(model, set()) if init else ():  # as model.apply(init_weights) runs it
        on_cpu(m, lambda m=m: init(m), done)
    for name, m in model.named_modules():  # a constructor's buffer, a parametrisation's original
        if unset := [n for _, _, n, t in held(m) if id(t) not in done]:
            raise TypeError(
                f"{name or 'model'} ({type(m).__name__}) has tensors that no reset_parameters() "
                f"sets ({', '.join(unset)}) on the meta device: it keeps no constructor's values; "
                "set them in its reset_parameters() or init_weights(), or META = False in the task"
            )
    return model


def post_order(module, seen):
    for child in module.children():
        if child not in seen:
            yield from post_order(child, seen)
    seen.add(module)
    yield module


def reset_of(module):  # _reset_parameters: attention's
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def held(module, recurse=False):
    """(owner, "_parameters" or "_buffers", name, tensor) of each tensor of `module` (or below)."""
    for owner in module.modules() if recurse else [module]:
        for kind in ("_parameters", "_buffers"):
            yield from ((owner, kind, n, t) for n, t in vars(owner)[kind].items() if t is not None)


@torch.no_grad()
def on_cpu(module, init, done, recurse=False):
    """init() on whole CPU copies of `module`'s tensors (values so far if `done`) over NaN; if a NaN
    or an integer is left, again over 0 from the same generator state: what both keep is set."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    slots, state, runs = list(held(module, recurse)), torch.get_rng_state(), []
    so_far = {id(t): getattr(t, "full_tensor", t.detach)() for *_, t in slots if id(t) in done}
    try:  # an integer, a NaN on purpose, a write through .data: each told by its values
        for fill in (torch.nan, 0):
            torch.set_rng_state(state)
            for owner, kind, name, t in slots:
                blank = torch.full(t.shape, fill if t.is_floating_point() or not fill else 1)
                whole = (so_far[id(t)] if id(t) in done else blank).to("cpu", t.dtype, copy=True)
                whole = nn.Parameter(whole, t.requires_grad) if kind == "_parameters" else whole
                getattr(owner, kind)[name] = whole
            init()
            runs.append([getattr(owner, kind)[name] for owner, kind, name, _ in slots])
            if all(w.is_floating_point() and not w.isnan().any() for w in runs[0]):
                break  # each set by the first run: no second (a layer's init, once)
    finally:
        for owner, kind, name, t in slots:
            getattr(owner, kind)[name] = t
    for (*_, t), before, whole in zip(slots, runs[0], runs[-1], strict=True):
        if not (before.eq(whole) | before.isnan() & whole.isnan()).all():
            continue  # left unset by init(), or in part: named after, unless set before
        done.add(id(t))
        if isinstance(t, DTensor):  # this rank's piece, cut as fully_shard cut it, locally
            mesh, placements, t = t.device_mesh, t.placements, t.to_local()
            whole = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
        t.copy_(whole)
