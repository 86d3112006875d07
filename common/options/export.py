"""--save-model (save_model()): the trained weights alone, as pytorch/examples saves them, for
inference or as a task's weights(args) to start from: a file any stage loads, whichever wrote it."""

import torch

from common.checkpoint import atomic, unwrap
from common.environment import is_rank0


def save_model(model, output_dir, guard):
    """The whole weights, as stage 01's model names them: from any stage, a file any stage loads.
    Every rank calls; `guard` checks the folder is still the run's before rank 0 writes there."""
    weights = unwrap(model).state_dict()
    if any(hasattr(w, "to_local") for w in weights.values()):  # stage 05's: gathered on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=whole)
    guard.check_folder()  # guard: moved or replaced since the last save: model.pt lands nowhere
    if is_rank0():
        with atomic(output_dir / "model.pt") as f:
            torch.save(weights, f)
