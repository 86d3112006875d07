"""A task's hooks beyond model() and datasets() (common/tasks/README.md), read where a task defines
them: its own metric and score() (metric()); its collate() is the loaders' (loaders.py)."""

from common.metrics import Metric


def metric(task):
    """The task's `metric = ("mae", "lower")` and its `score(output, target)` summed over a batch:
    the epoch lines, metrics.csv (test_mae), --target and the tools follow it."""
    return Metric(*task.metric, task.score)
