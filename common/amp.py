"""Mixed precision (--amp): bf16 where the device has it, else fp16 with a gradient scaler."""

import torch


def dtype(device):
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # e.g. V100: fp16 needs loss scaling, or small gradients underflow
    return torch.bfloat16  # bf16 keeps fp32's range: no scaling needed


def autocast(device, args):
    return torch.autocast(device.type, dtype=dtype(device), enabled=args.amp)


def scaler(device, args):
    """A pass-through unless fp16 is used; its state goes into the checkpoints either way."""
    return torch.amp.GradScaler(device.type, enabled=args.amp and dtype(device) == torch.float16)


def policies(device, args):
    """Stage 05's policies for fully_shard: blocks', BatchNorm layers', root's. Under --amp a block
    is gathered and computes in bf16, hands bf16 on; sharded weights, optimizer and the gradients'
    reduction stay fp32, as BatchNorm (fp32 statistics) and the loss the root hands back."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # here: its import costs 0.7 s

    if not args.amp:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy(), MixedPrecisionPolicy()
    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(blocks.param_dtype, blocks.reduce_dtype, output_dtype=torch.float32)
    norms = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    return blocks, norms, root
