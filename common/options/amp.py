"""--amp: mixed precision. The forward runs in bf16 where the device has it, else fp16 with a
gradient scaler (V100): half the memory traffic of fp32, and tensor cores, for the same updates
within bf16's precision; weights, optimizer state and the loss stay fp32 (autocast()). Stage 05
sets FSDP2's precision policies instead (policies())."""

import torch


def dtype(device):
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # e.g. V100: fp16 needs loss scaling, or small gradients underflow
    return torch.bfloat16  # bf16 keeps fp32's range: no scaling needed


def mixed(step, states):
    """`step` run under autocast, its loss scaled where fp16 needs it; the scaler's state goes into
    the checkpoints (`states`)."""
    scaler = torch.amp.GradScaler(step.device.type, enabled=dtype(step.device) == torch.float16)
    states["scaler"] = scaler

    def train_step(step, x, y):
        with torch.autocast(step.device.type, dtype=dtype(step.device)):
            loss = step.loss_fn(step.model(x), y)
        scaler.scale(loss).backward()
        scaler.step(step.optimizer)
        scaler.update()
        return loss.detach()

    return step._replace(run=train_step)


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
