"""Saving and loading model weights, interchangeable between the stages."""

import torch
import torch.distributed as dist


def unwrap(model):
    """The plain model inside DataParallel or DistributedDataParallel: weights saved from it carry no
    `module.` prefix, so any stage loads them."""
    return getattr(model, "module", model)


def save_model(model, output_dir):
    if not dist.is_initialized() or dist.get_rank() == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(unwrap(model).state_dict(), output_dir / "model.pt")
