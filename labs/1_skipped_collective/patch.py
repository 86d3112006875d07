"""One rank skips a collective: the job hangs."""

PATCH = [
    ("dist.all_reduce(totals)", "before",
     "if dist.get_rank() == 0:  # lab 1: rank 0 waits for the others before its report; they never come\n"
     "    dist.barrier()"),
]  # fmt: skip
ARGS = ["--epochs", "1", "--limit", "512"]
TOOLS = ["py-spy"]
