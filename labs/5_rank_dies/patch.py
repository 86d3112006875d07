"""A rank dies (out of memory) while the others wait in a collective."""

PATCH = [
    ("step.optimizer.zero_grad(set_to_none=True)", "before",
     "if dist.get_rank() == 1 and batch_idx == 2:  # lab 5: rank 1 runs out of memory at its third step\n"
     "    raise torch.OutOfMemoryError(\"lab 5: out of memory on rank 1 alone\")"),
]  # fmt: skip
ARGS = ["--epochs", "1", "--limit", "512"]
TOOLS = []
