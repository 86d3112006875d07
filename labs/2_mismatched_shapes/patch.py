"""Ranks enter a collective with other shapes: a rank-dependent tensor size."""

PATCH = [
    ("dist.all_reduce(totals)", "before",
     "if dist.get_rank() == 1:  # lab 2: one number more on rank 1 (a metric only it computes)\n"
     "    totals = torch.cat([totals, totals[:1]])"),
]  # fmt: skip
ARGS = ["--epochs", "1", "--limit", "512"]
TOOLS = ["py-spy"]
