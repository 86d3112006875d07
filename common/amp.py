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
    """Stage 05: FSDP's mixed precision, for fully_shard: the blocks', BatchNorm layers' and root's
    policies. Under --amp each block's weights are gathered and computed in bf16 and its output
    passed on in bf16 (to the next block, or to the root's layers after the last: a classifier's
    head); sharded weights, optimizer and gradient reduction stay fp32, the root hands the loss
    fp32; BatchNorm computes in fp32 (its running statistics are fp32), hands bf16 on. Else fp32.
    (The guard rails refuse --amp without FSDP or bf16: preflight.check_amp().)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # here: its import costs 0.7 s

    if not args.amp:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy(), MixedPrecisionPolicy()
    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(blocks.param_dtype, blocks.reduce_dtype, output_dtype=torch.float32)
    norms = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    return blocks, norms, root
