"""One rank runs one step more than the others: an uneven shard."""

PATCH = [
    ("for batch_idx, (x, y) in enumerate(loader):", "replace",
     "# lab 3: a shard cut by hand, not by DistributedSampler: rank 0's holds one batch more\n"
     "batches = [*loader, *([next(iter(loader))] if dist.get_rank() == 0 else [])]\n"
     "for batch_idx, (x, y) in enumerate(batches):"),
]  # fmt: skip
ARGS = ["--epochs", "1", "--limit", "512"]
TOOLS = []
