"""Guard rail: the options that define a run, and those that do not. A checkpoint stores the defining ones
(preflight.defining()); a resumed run, and every rank of a run, must have the same (resume.py, preflight.py).
Every option of every stage and of the built-in task is in one of the two (tests/test_cli.py): a new option
is classified where it is added."""

# What a run computes: stored in its checkpoint, compared on resume and across the ranks. (--epochs
# too under --scheduler cosine: see preflight.defining().)
DEFINING = (
    "task", "dataset", "model", "depth", "width", "sync_bn",  # the network and what it learns
    # the global batch, the training set and its shuffles
    "batch_size", "val_fraction", "limit", "seed",
    # the updates
    "optimizer", "lr", "lr_scaling", "momentum", "weight_decay", "scheduler", "gamma", "step_size",
    "amp",  # the precision, and the scaler state a checkpoint holds
    # compiled kernels round differently from eager ones: the same run only with the same choice
    "compile",
    # one batch per epoch: its checkpoints are no part of a real run; ranks that differ hang
    "dry_run",
)  # fmt: skip
FREE = (
    # a resumed run may be given more or fewer epochs to go (not under cosine: defining())
    "epochs",
    # what is printed and written, not computed
    "log_interval", "save_model", "output_dir", "resume", "check",
    # where batches come from: the three loaders give the same batches
    "data_dir", "num_workers", "loader",
    "test_batch_size",  # evaluation sums do not depend on how they are split into batches
    # where it runs and how long a collective waits: checkpoints load on any device
    "no_cuda", "dist_timeout",
    # stage 05: how the same global batch fits in memory (not BatchNorm's statistics, which see the
    # micro-batches); a job requeued onto fewer GPUs may need more accumulation than before
    "grad_accum", "checkpoint_activations",
    "full_shard",  # the mesh: a sharded checkpoint loads into any
    # when to stop early: a resumed run may change its mind
    "target", "target_accuracy", "patience",
    # how often a run saves mid-epoch: the saves change nothing that is computed
    "checkpoint_minutes",
)  # fmt: skip
