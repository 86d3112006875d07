"""Guard rail: the options that define a run, those that do not, and the range of every number (RANGES, below, which
check.check_args() holds each run to). A checkpoint stores the defining ones (preflight.defining()); a resumed run,
and every rank of a run, must have the same (resume.py, preflight.py). Every option of every stage and of the
built-in task is in one of the two (tests/test_cli.py): a new option is classified where it is added."""

import argparse
import inspect
import math

# What a run computes: stored in its checkpoint, compared on resume and across the ranks. (--epochs
# too under --scheduler cosine: see preflight.defining().)
DEFINING = (
    "task",
    "dataset",
    "model",
    "depth",
    "width",
    "sync_bn",  # the network and what it learns
    # the global batch, the training set and its shuffles
    "batch_size",
    "val_fraction",
    "limit",
    "seed",
    # the updates
    "optimizer",
    "lr",
    "lr_scaling",
    "momentum",
    "weight_decay",
    "scheduler",
    "gamma",
    "step_size",
    "clip_grad",
    "amp",  # the precision, and the scaler state a checkpoint holds
    # compiled kernels round differently from eager ones: the same run only with the same choice
    "compile",
    # stage 05: each slice of a batch draws its own dropout (and BatchNorm sees each slice): other numbers
    "grad_accum",
    # one batch per epoch: its checkpoints are no part of a real run; ranks that differ hang
    "dry_run",
)
FREE = (
    # a resumed run may be given more or fewer epochs to go (not under cosine: defining())
    "epochs",
    # what is printed and written, not computed
    "log_interval",
    "save_model",
    "output_dir",
    "resume",
    "check",
    # where batches come from: the three loaders give the same batches
    "data_dir",
    "num_workers",
    "loader",
    "test_batch_size",  # the same sums in another order: rounding alone, 1e-7 (a task's batch loss may differ)
    # where it runs and how long a collective waits: checkpoints load on any device
    "no_cuda",
    "dist_timeout",
    # stage 05: recomputing activations in the backward draws the same dropout (torch restores the RNG)
    "checkpoint_activations",
    "full_shard",  # the mesh: a sharded checkpoint loads into any
    # when to stop early: a resumed run may change its mind
    "target",
    "patience",
    # how often a run saves mid-epoch: the saves change nothing that is computed
    "checkpoint_minutes",
)

# What each number may be: a value outside is a usage error, in one line (check.check_args()). The
# stages' numbers and the built-in tasks' (common/tasks/); 3.4e38 is about float32's largest, which
# optimizers compute in.
POSITIVE, FRACTION = "[1, inf)", "[0, 1)"
RANGES = {
    # 2**63 and past failed in the loader's islice(), after the start-up, naming no flag (a float: exact at 2**63)
    "batch_size": "[1, 9223372036854775808)",
    "test_batch_size": "[1, 9223372036854775808)",
    "epochs": POSITIVE,
    "log_interval": POSITIVE,
    "limit": POSITIVE,
    "step_size": POSITIVE,
    "patience": POSITIVE,
    "grad_accum": POSITIVE,
    "lr": "(0, 3.4e38]",
    "weight_decay": "[0, 3.4e38]",
    "gamma": "(0, 1]",
    "momentum": FRACTION,
    "val_fraction": FRACTION,
    "target": "(-inf, inf)",
    "num_workers": "[0, inf)",
    "checkpoint_minutes": "(0, inf)",
    "clip_grad": "(0, 3.4e38]",
    "seed": "[0, 4294967295]",  # numpy.random.seed's limit; past 2**64 torch.manual_seed crashes
    # a collective that waits a day is a hang: a larger value is a typo (milliseconds?), and past
    # datetime.timedelta's range it would crash the process group's setup
    "dist_timeout": "[1, 86400]",
    "depth": POSITIVE,
    "width": POSITIVE,
    "dim": POSITIVE,
    "layers": POSITIVE,
    "heads": POSITIVE,
    "vocab": POSITIVE,
    "samples": POSITIVE,
    "seq_len": POSITIVE,
    "max_len": POSITIVE,
}


def outside(value, interval):
    """Is `value` outside `interval`, written "(0, 1]" or "[1, inf)"? nan fails every comparison
    and inf lies outside every interval, so neither is inside."""
    low, high = (float(end.strip("([]) ")) for end in interval.split(","))
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    return not (above and below)


def out_of_range(args):
    """The first option of `args` outside its RANGES, as a usage error's words; else None."""
    for name, interval in RANGES.items():
        value = getattr(args, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and outside(value, interval):
            what = "an integer" if isinstance(value, int) else "a number"
            return f"argument --{name.replace('_', '-')}: must be {what} in {interval}, got {value}"
    return None


def used(flags):
    """`flags` ({dest: value}: a run's options, or a manifest's record of them) without the values the recipe they
    select never reads (recipes.py): --momentum but with sgd and rmsprop, --step-size and --gamma with the cosine
    schedule. Not part of what the run computes, they are neither recorded nor compared (a run that recorded one
    resumes)."""
    never = set()
    if flags.get("optimizer", "sgd") not in ("sgd", "rmsprop"):
        never.add("momentum")
    if flags.get("scheduler") == "cosine":
        never |= {"step_size", "gamma"}
    return {k: v for k, v in flags.items() if k not in never}


def unread(args, argv):
    """A recipe flag typed in `argv` with a value the recipe it selects never reads (used()), as a usage error's
    words; else None: --momentum with adadelta or adam was trained without. A task's default for it is no one's
    mistake: where the user picks another optimizer, the run goes on without it."""
    dropped = vars(args).keys() - used(vars(args)).keys()
    if "momentum" in dropped and args.momentum and given(argv, "--momentum"):
        return f"argument --momentum: {args.optimizer} has none (sgd's and rmsprop's): drop it, or --optimizer sgd"
    if "step_size" in dropped and args.step_size != 1 and given(argv, "--step-size"):
        return "argument --step-size: the cosine schedule takes no steps (--scheduler step's): drop it"
    if "gamma" in dropped and given(argv, "--gamma"):  # typed: its default is no one's choice
        return "argument --gamma: the cosine schedule has no decay factor (--scheduler step's): drop it"
    return None


def replaced(unused, argv):
    """A flag typed in `argv` that the task's own optimizer() or scheduler() replaces and never reads (hooks.recipe()'s
    `unused`), as a usage error's words; else None: --lr-scaling linear was recorded as applied, and changed nothing."""
    flags = {f"--{flag.replace('_', '-')}" for flag in unused}
    typed = [word.partition("=")[0] for word in argv if word.partition("=")[0] in flags]
    return f"argument {typed[0]}: the task's optimizer() and scheduler() never read it: drop it" if typed else None


# the lesson's --lr (common/cli.py): Adadelta's rate in pytorch/examples' recipe, not another optimizer's; and the
# default rate of each other one in torch.optim, named where that rate is refused for them
LESSON_LR = 1.0
TORCH_LR = {"adam": 1e-3, "rmsprop": 1e-2, "sgd": 1e-3}


def unset_rate(args, argv):
    """Another optimizer than Adadelta (a flag's or the task's) at the lesson's --lr, which nobody gave, as a usage
    error's words; else None: Adam, RMSprop or SGD at Adadelta's 1.0 trains, logs and saves numbers of a run nobody
    meant (Adam's loss in the millions). A task that sets its own --lr, or a --lr typed (1.0 too), runs."""
    if args.optimizer != "adadelta" and args.lr == LESSON_LR and not given(argv, "--lr"):
        return (
            f"argument --optimizer: {args.optimizer} at --lr's default, {LESSON_LR}, which is Adadelta's rate: give "
            f"{args.optimizer}'s own with --lr (torch's default for it: {TORCH_LR[args.optimizer]:g})"
        )
    return None


def unset_task_rate(optimizer, args, argv):
    """A task's own optimizer() at the lesson's --lr, which nobody gave, where its class's own default is another
    (AdamW's 1e-3), as a usage error's words; else None: as unset_rate() for --optimizer's (the recipe example ran
    AdamW at 1.0 and scored chance, 24 %, unsaid). Of each parameter group its rate before a schedule's first
    factor (a warm-up's 0)."""
    own = inspect.signature(type(optimizer)).parameters.get("lr")
    default = own.default if own is not None else None
    rates = {group.get("initial_lr", group["lr"]) for group in optimizer.param_groups}
    unset = args.lr == LESSON_LR and LESSON_LR in rates and not given(argv, "--lr")  # the rate: --lr's default
    if unset and isinstance(default, int | float) and default != LESSON_LR:
        return (
            f"argument --lr: the task's {type(optimizer).__name__} at --lr's default, {LESSON_LR}, which is "
            f"Adadelta's rate: give its own with --lr (torch's default for it: {default:g})"
        )
    return None


def given(argv, flag):
    """The values `flag` is given in `argv`, typed in full as the parsers require (allow_abbrev=False): the value after
    its `=`, else the next word (None after the last)."""
    values = []
    for word, after in zip(argv, [*argv[1:], None], strict=False):
        name, attached, value = word.partition("=")
        if name == flag:
            values.append(value if attached else after)
    return values


def number(kind, interval):
    """An argparse type for the tools' own options: a `kind` (int or float) in `interval`."""

    def check(text):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if outside(value, interval):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} in {interval}, got {text}")
        return value

    return check
