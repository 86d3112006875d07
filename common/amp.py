"""Mixed precision (--amp): bf16 where the device has it, else fp16 with a gradient scaler."""

import torch


def dtype(device):
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # e.g. V100: fp16 needs loss scaling, or small gradients underflow to zero
    return torch.bfloat16  # bf16 keeps fp32's range: no scaling needed


def autocast(device, args):
    return torch.autocast(device.type, dtype=dtype(device), enabled=args.amp)


def scaler(device, args):
    """A pass-through unless fp16 is used; its state goes into the checkpoints either way."""
    return torch.amp.GradScaler(device.type, enabled=args.amp and dtype(device) == torch.float16)
