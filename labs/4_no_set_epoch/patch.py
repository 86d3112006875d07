"""No sampler.set_epoch(epoch): no hang, but every epoch sees the same order."""

PATCH = [
    ("train_sampler.set_epoch(epoch)", "replace", ""),  # lab 4: the line that reshuffles is gone
    ("step.optimizer.zero_grad(set_to_none=True)", "before",
     "if batch_idx == 0:  # lab 4's probe: what this rank drew first in each epoch\n"
     "    print(f\"rank {dist.get_rank()} epoch {epoch} drew labels {y[:12].tolist()}\", flush=True)"),
]  # fmt: skip
ARGS = ["--epochs", "2", "--limit", "256"]
TOOLS = ["drawn"]
