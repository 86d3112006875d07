"""Guard rail: the checks that need no torch, of the options and of the launcher's variables, before anything
starts (the address and port where setup() meets the other ranks: rendezvous.py). Run as
`python -m common.guards.check ARGS...` it is a job script's check before torchrun starts its workers: ARGS
as the stage in this folder takes them, and a torch too old for that stage, in a tenth of a second; a usage
error ends the job once, not once per worker and restart. Silent on success."""

import os
import re
import sys
from pathlib import Path

from common import cli
from common.environment import count, cpus_per_rank, first_host, is_rank0, launcher
from common.guards import options, versions
from common.guards.bounded import regular_file
from common.guards.ending import Refusal
from common.options import flags

REQUIRED = object()
# about float32's largest: optimizers compute in it, and a larger --lr or --weight-decay overflows
FLOAT32_MAX = 3.4e38


def integer(name, default=REQUIRED, env=os.environ, low=0, high=None):
    """env[name] as an integer in [low, high]; `default` if it is unset or empty, or an error if required. A
    variable missing where the launch needs it, or set but not a number in range (a typo in a launch by hand,
    a wrapper exporting garbage), is one line naming it and its value instead of a ValueError or KeyError."""
    value = env.get(name, "").strip()
    if not value:
        if default is REQUIRED:
            raise Refusal(
                f"error: {name} is not set, and this launch needs it: start the ranks with torchrun or srun (or, "
                "by hand, set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank)"
            )
        return default
    number = count(value)  # as launcher() reads it: the value checked is the value used
    if number is None or number < low or (high is not None and number > high):
        within = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise Refusal(
            f"error: {name}={env[name]!r} is not an integer {within}: the launcher (torchrun, srun) sets it; "
            "if you set it yourself, correct or unset it"
        )
    return number


def check_environment(env=os.environ):
    """Every launcher variable the lesson reads (check_launcher()); and a launch that has none although the job has
    several tasks."""
    check_launcher(env)
    launched = "RANK" in env or ("SLURM_PROCID" in env and "SLURM_STEP_ID" in env)  # torchrun, srun
    if not launched and integer("SLURM_NTASKS", 1, env=env) > 1:
        raise Refusal(
            f"error: this job has SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not one of its "
            "tasks (it runs in the batch script or an salloc shell): launch train.py with `srun python "
            "train.py`, or with torchrun (stages 01 and 02 train in one process: `srun --ntasks=1`)"
        )


def check_launcher(env=os.environ):
    """Every launcher variable the lesson reads (common/environment.py launcher() and its neighbours), before it
    reads them: the job scripts' check too, which runs in the batch shell."""
    for name in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES"):
        integer(name, None, env=env, low=1)
    if "RANK" in env:  # torchrun, or by hand
        integer("RANK", env=env), integer("LOCAL_RANK", env=env), integer("WORLD_SIZE", env=env, low=1)
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise Refusal(
                "error: RANK is set but MASTER_ADDR or MASTER_PORT is not: export both (rank 0's host "
                "and a free port), or launch with torchrun"
            )
        integer("MASTER_PORT", env=env, low=1, high=65535)
        torchrun = "TORCHELASTIC_RUN_ID" in env  # `srun torchrun`: its RANK wins; else a job exported them
        srun = [count(env.get(k)) for k in ("SLURM_PROCID", "SLURM_NTASKS")] if "SLURM_STEP_ID" in env else None
        if srun and not torchrun and srun != [count(env["RANK"]), count(env["WORLD_SIZE"])]:
            raise Refusal(
                f"error: RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} in an srun task that is "
                f"task {srun[0]} of {srun[1]}: unset RANK, WORLD_SIZE and MASTER_ADDR before srun (the "
                "job exports them into every task), or launch with torchrun"
            )
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun task
        if not env.get("SLURM_JOB_NODELIST"):
            raise Refusal("error: SLURM_JOB_NODELIST is not set in this srun task: launch it with srun in a job")
        check_hostlist(env["SLURM_JOB_NODELIST"])
        integer("SLURM_PROCID", env=env), integer("SLURM_LOCALID", env=env), integer("SLURM_NTASKS", env=env, low=1)
        integer("MASTER_PORT", None, env=env, low=1, high=65535) or integer("SLURM_JOB_ID", env=env)


def check_hostlist(hostlist):
    """A hostlist environment.first_host() can read: brackets that match, each holding numbers and ranges."""
    parts = [part for group in re.findall(r"\[([^\]]*)\]", hostlist) for part in group.split(",")]
    ranges = [re.fullmatch(r"(\d+)(?:-(\d+))?", part) for part in parts]
    valid = hostlist.count("[") == hostlist.count("]") and all(r and int(r[2] or r[1]) >= int(r[1]) for r in ranges)
    if not valid or not first_host(hostlist):  # "," names no host: no group would form
        raise Refusal(f"error: cannot read the Slurm hostlist {hostlist!r}: set SLURM_JOB_NODELIST as Slurm writes it")


def say(message):
    """A usage error, once: from rank 0 where a launcher gives every rank the same arguments (torchrun, srun)."""
    by_hand = "TORCHELASTIC_RUN_ID" not in os.environ and "SLURM_STEP_ID" not in os.environ
    if is_rank0() or by_hand or launcher().rank is None:  # a rank unread (its variable refused next): say it
        print(message, file=sys.stderr)


# stage 05's own options (flags.large()): given to another stage, argparse would call them unknown
LARGE = ("--grad-accum", "--checkpoint-activations", "--full-shard")


def refuse(message):
    """Say a usage error (the parser's cli.UsageError, or a check's) in one line, from rank 0: exit status 2."""
    taught = [flag for flag in LARGE if message.startswith("unrecognized arguments") and flag in message]
    if taught:  # an unknown flag, it would mislead
        message = f"{taught[0]} is taught in stage 05_fsdp, not here: run 05_fsdp/train.py"
    say(f"error: {message} (see --help)")
    return 2


def usage(message):
    raise Refusal(refuse(message))


def said(err):
    """A cli.UsageError's words. A task's check(args) returns what is wrong, in words, or None: anything else it
    returned (True, for "the options are fine") is named, not printed as the error."""
    message = err.args[0] if err.args else ""
    if isinstance(message, str):
        return message
    return f"the task's check(args) returned {message!r}: it returns what is wrong with the options, in words, or None"


class Parser(cli.Parser):
    """The tools' parser: a usage error is one line (usage()), not the lesson's exception."""

    def error(self, message):
        usage(message)


def task_file(argv=None):
    """The --task file the lesson will read (cli.task_path()), unless reading it could block or never end (a FIFO,
    /dev/zero): an OSError before it is opened."""
    regular_file(cli.task_path(argv))


def parse_args(argv=None, groups=()):
    """cli.parse_args() with the guard rails' checks of what it parsed: a usage error, or a number outside
    its range, is one line (usage()). The tools' and the job scripts' reading of a stage's options."""
    task_file(argv)
    try:
        args, task = cli.parse_args(argv, [flags.add, *groups])
    except cli.UsageError as err:
        usage(said(err))
    if problem := options.out_of_range(args):
        usage(problem)
    return args, task


def check_args(args, warn=True, gpus=None, argv=None):
    """What the parser cannot see alone, then --check's exit. Rank 0 alone reads a checkpoint, and on nodes that
    share no filesystem only its node has the file: a --resume PATH that is no checkpoint is one line before
    anything starts (a FIFO would hang torch.load, a directory make it fail with a traceback). `gpus`: those the
    run would use, where torch is loaded to count them (a stage, its --check too), else None; then the data
    files are checked too."""
    argv = sys.argv[1:] if argv is None else argv  # the command line as typed: what the user gave, not a default
    problem = options.out_of_range(args) or options.unread(args, argv) or options.unset_rate(args, argv)
    if problem := problem or empty_path(argv):
        usage(problem)  # the parser reads numbers and paths, each flag alone
    if args.sync_bn and gpus == 0:
        usage("--sync-bn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only) and this run has none: drop it on CPUs")
    if flags.learning_rate(args) > FLOAT32_MAX:
        usage(f"--lr {args.lr:g} scaled to --batch-size {args.batch_size} ({args.lr_scaling}) overflows float32")
    path = args.resume
    if isinstance(path, Path) and is_rank0() and not (path.is_file() or (path / "state.pt").is_file()):
        what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        usage(
            f"argument --resume: {path} {what}: give a checkpoint file (<output-dir>/checkpoint.pt) or, from "
            "stage 05, a checkpoint folder (<output-dir>/checkpoint)"
        )
    for name, value in vars(args).items():
        if not plain(value):  # the run's manifest records them, as JSON
            usage(
                f"--{name.replace('_', '-')} is a {type(value).__name__} ({value!r:.60}): an option of a task must "
                "be a str, int, float, bool, None or a list of them: give its add_argument() such a type="
            )
    cpus = cpus_per_rank()
    if args.num_workers is not None and args.num_workers > cpus:
        if warn:
            say(f"warning: --num-workers {args.num_workers} is more than the {cpus} CPUs per rank here: using {cpus}")
        args.num_workers = cpus
    if gpus is not None:  # a stage, torch loaded: the data files it reads, before the lesson trusts them
        from common.guards import datafiles  # here: the job scripts' check runs without torch

        datafiles.check(args)
    if args.check:  # the options hold for this stage: nothing else to do
        raise SystemExit(0)


def empty_path(argv):
    """A path option given empty, as "$OUT" is where OUT is unset: the parser makes it the folder the run starts in,
    where the run would write its checkpoints (or read its data) unasked. (An empty --task is that folder: no file.)"""
    for path in ("--data-dir", "--output-dir", "--resume"):
        if any(value is not None and not value.strip() for value in options.given(argv, path)):
            return f"argument {path}: an empty path (an unset variable?): give the path itself"
    return None


def plain(value):
    """A value a checkpoint loads with weights_only=True, exactly of these types: an IntEnum is an int that does not."""
    if type(value) in (list, tuple):
        return all(plain(item) and not isinstance(item, Path) for item in value)  # defining() makes Paths str
    return type(value) in (str, int, float, bool, type(None)) or isinstance(value, Path)


if __name__ == "__main__":
    submitted = Path(os.environ.get("SLURM_SUBMIT_DIR", "."))  # a job's: sbatch 03_ddp_single_node/job.slurm
    if "SLURM_SUBMIT_DIR" in os.environ and not (submitted / "train.py").is_file():  # torchrun ran no train.py
        sys.exit(f"error: no train.py in {submitted}: submit the job from its stage's folder (cd it; sbatch ...)")
    versions.require(Path("train.py"))  # job scripts run in the stage's folder
    check_launcher()  # before a usage error's rank-0 test reads them
    try:
        check_args(parse_args(sys.argv[1:])[0], warn=False)
    except (OSError, SyntaxError) as err:  # reading the options: the task file
        sys.exit(f"error: --task {err.filename}: {getattr(err, 'strerror', None) or err.msg}")
