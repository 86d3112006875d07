"""What the job scripts share stays the same text everywhere, so that it never shows in the diffs
between stages (their lengths: test_budgets.py)."""

from helpers import REPO

SCRIPTS = sorted(REPO.glob("0*/*.slurm"))
SWEEP = REPO / "sweeps/batch_size.slurm"


def block(path, first="# GPU use every 5 s", last="fi"):
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return lines[start : lines.index(last, start) + 1]


def test_gpu_log_block_is_the_same_in_every_job_script():
    blocks = {path.relative_to(REPO).as_posix(): block(path) for path in SCRIPTS}
    first = blocks["01_single_gpu/job.slurm"]
    assert len(blocks) == 5 and all(b == first for b in blocks.values()), blocks
    # the sweep names its GPU log as its log, after the array: %x-%A_%a
    sweep = [line.replace("${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID", "$SLURM_JOB_ID") for line in block(SWEEP)]
    assert sweep == first
