"""The options' flags, beside the lesson's own (common/cli.py): a stage passes add() to
cli.parse_args(), stage 05 large() too. Each help names the module that does what the flag turns
on. Read without torch: a job script's check parses them before torchrun starts its workers."""

REFERENCE_BATCH = 64  # the global batch --lr is given for (--lr-scaling)
# The recipe the lesson trains with (common/optim.py: Adadelta, StepLR each epoch), as the flags'
# values. A run whose args hold another, whoever set it (a flag, a task's default or check()),
# enters hooks.recipe(), which builds it: LESSON.items() - vars(args).items() is what differs.
# LARGE: stage 05's, with --grad-accum.
LESSON = {
    "optimizer": "adadelta",
    "momentum": 0.0,
    "weight_decay": 0.0,
    "scheduler": "step",
    "step_size": 1,
    "lr_scaling": "none",
    "clip_grad": None,
}
LARGE = LESSON | {"grad_accum": 1}


def learning_rate(args):
    """--lr for this run's global batch: --lr-scaling's rule (recipes.py says why each)."""
    ratio = args.batch_size / REFERENCE_BATCH
    return args.lr * {"none": 1, "linear": ratio, "sqrt": ratio**0.5}[args.lr_scaling]


def recipe(p):
    """The recipe's flags; add() gives them the lesson's values (LESSON) as their defaults."""
    recipe = p.add_argument_group("the recipe (recipes.py)").add_argument
    recipe(
        "--optimizer", choices=["adadelta", "adam", "rmsprop", "sgd"], help="(default: adadelta)"
    )
    recipe("--momentum", type=float, help="sgd's and rmsprop's (default: 0)")
    recipe("--weight-decay", type=float, help="(default: 0)")
    recipe(
        "--scheduler", choices=["step", "cosine"], help="StepLR, or to 0 by cosine (default: step)"
    )
    recipe("--step-size", type=int, help="epochs per step of --scheduler step (default: 1)")
    recipe(
        "--lr-scaling", choices=["none", "linear", "sqrt"], help="for --batch-size (default: none)"
    )


def add(p):
    """The options every stage takes."""
    recipe(p)
    rails = p.add_argument_group("the guard rails' (common/guards/)").add_argument
    rails("--check", action="store_true", help="check the options and exit (0, or 2 with one line)")
    rails("--checkpoint-minutes", type=float, metavar="M", help="also save every M minutes")
    add = p.add_argument_group("options (common/options/)").add_argument
    add(
        "--save-model",
        action="store_true",
        help="save the model to --output-dir/model.pt (export.py)",
    )
    add(
        "--loader",
        choices=["batched", "classic", "device"],
        default="batched",
        help="whole batches from decoded tensors (default), pytorch/examples' per sample, or all "
        "on the GPU (loaders.py)",
    )
    add(
        "--num-workers",
        type=int,
        help="DataLoader workers per process (default: none for "
        "--loader batched; for classic, the CPUs per rank but one) (loaders.py)",
    )
    add(
        "--amp",
        action="store_true",
        help="mixed precision: bf16, else fp16 with loss scaling (amp.py)",
    )
    add(
        "--compile",
        action="store_true",
        help="torch.compile: fused kernels (per block in stage "
        "05); on one GPU the step one CUDA graph (compiling.py)",
    )
    add(
        "--val-fraction",
        type=float,
        default=0.0,
        help="held out for validation (default: 0) (holdout.py)",
    )
    add(
        "--target",
        type=float,
        help="stop once the last --patience evaluations reach this value "
        "of the task's metric (accuracy: in %%, at least) (holdout.py)",
    )
    add("--patience", type=int, default=1, help="see --target (default: 1) (holdout.py)")
    add(
        "--clip-grad",
        type=float,
        metavar="NORM",
        help="clip the gradients' global norm to NORM before each optimizer step "
        "(after --amp's unscaling; stage 05: the sharded gradients) (hooks.py)",
    )
    p.set_defaults(**LESSON)  # the recipe's flags (--clip-grad too): the lesson's values


def large(p):
    """Stage 05's: the memory savers and the mesh (large.py)."""
    add = p.add_argument_group("large models (common/options/large.py)").add_argument
    add(
        "--grad-accum",
        type=int,
        metavar="N",
        help="each rank's batch in N "
        "micro-batches, gradients reduced once after the last (default: 1)",
    )
    add(
        "--full-shard",
        action="store_true",
        help="shard across all ranks (FSDP), not within "
        "each node with a copy per node (HSDP, the default on several nodes)",
    )
    add(
        "--checkpoint-activations",
        action="store_true",
        help="keep each block's input alone and "
        "recompute the rest in the backward: less memory, a forward more of time",
    )
    p.set_defaults(grad_accum=LARGE["grad_accum"])  # one micro-batch: the lesson's step
