"""Guard rail: stage 05's checkpoint folders as a run finds them: epoch-N (and epoch-N-step-S), newest first, and the
links `checkpoint` and `checkpoint-previous` that name two of them (common/sharded.py), which a copy may have made
folders."""

from common.checkpoint import SHARDED
from common.guards.ending import Refusal


def position(folder):
    """(epoch, step) of stage 05's folder epoch-N (the end of epoch N: step infinite) or epoch-N-step-S."""
    epoch, _, step = folder.name.removeprefix("epoch-").partition("-step-")
    if not (epoch + step).isdigit():
        return (-1, 0)
    return (int(epoch), int(step) if step else float("inf"))


def epochs(output_dir):
    """Stage 05's checkpoint folders in output_dir, newest first: epoch-N (the end of epoch N) and epoch-N-step-S
    (S steps into it)."""
    return sorted(output_dir.glob("epoch-*"), key=position, reverse=True)


def check(output_dir, fallback):
    """Stage 05's links, where there are any: links, not folders (a copy that followed them: scp -r, cp -rL), which
    the next save cannot switch: it failed after the epoch's training, at every resume. `fallback`: resume.fallback."""
    for link in (output_dir / SHARDED, output_dir / f"{SHARDED}-previous"):
        if link.exists() and not link.is_symlink():
            raise Refusal(
                f"error: {link} is a folder, not the link stage 05 keeps to an epoch-N folder beside it (a copy that "
                f"followed the links: scp -r, cp -rL): remove {SHARDED} and {SHARDED}-previous there"
                f"{fallback(output_dir, link) or ', then resume'}"
            )
