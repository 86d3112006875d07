"""What the guard rails cost a step: the progress line with the divergence check of the guard rails at the same
step (common.guards.divergence.loss_finite) against the plain line, the once-an-epoch finiteness scan of a
checkpoint (common.guards.divergence.finite), and the guard rails' work at the end of every step
(common.guards.rails.Guard.end_of_step: the stop signal), each beside the time of a training step of stage
01's Net at batch 64, on this machine's GPU or CPU.

    python bench/check_cost.py
    N=5 python bench/check_cost.py      # steps per round (default 100): the smallest run, a check of the script
"""

import argparse
import contextlib
import io
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import metrics, models
from common.guards import divergence, rails, saving
from common.guards.preemption import Preemption

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N = int(os.environ.get("N", "100"))
model = models.build("net", 1, 10, 28, 16, 4).to(device)
optimizer = torch.optim.Adadelta(model.parameters())
x, y = torch.randn(64, 1, 28, 28, device=device), torch.randint(0, 10, (64,), device=device)
totals = metrics.Sums.zeros(device)


def step():
    optimizer.zero_grad(set_to_none=True)
    loss = F.nll_loss(model(x), y)
    loss.backward()
    optimizer.step()
    totals.loss += loss.detach() * len(y)
    return loss


def seconds(fn, n):
    """Mean seconds per call of fn, the device's work included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


loss = step()
with contextlib.redirect_stdout(io.StringIO()):  # the lines themselves are not what is measured
    plain = lambda: metrics.progress(1, 0, 938, step())  # noqa: E731
    checked = lambda: (metrics.progress(1, 0, 938, step()), divergence.loss_finite(totals))  # noqa: E731
    run = rails.Guard()  # a stage's guard where no signal comes
    run.args = argparse.Namespace(
        checkpoint_minutes=None, log_interval=100, batch_size=64, output_dir=Path("runs"), dist_timeout=30
    )
    run.saving = saving.Saving(run.args, {}, False, None, run.progress)
    run.saving.preemption = Preemption(None, 30)
    stoppable = lambda: (step(), run.end_of_step(1, 1, totals))  # noqa: E731
    for fn in (step, plain, checked, stoppable):
        seconds(fn, min(N, 20))  # warm-up
    runs = {"step": [], "plain": [], "checked": [], "stoppable": []}
    for _ in range(5):  # alternated, so that drifts in clock or load hit all of them alike
        for name, fn in (("step", step), ("plain", plain), ("checked", checked), ("stoppable", stoppable)):
            runs[name].append(seconds(fn, N))
per = {name: sorted(times)[2] for name, times in runs.items()}  # the median of five
scan = seconds(lambda: divergence.finite([model.state_dict(), optimizer.state_dict()]), min(N, 20))
print(f"{device.type}: a step {per['step'] * 1e3:.3f} ms; a step with the plain progress line "
      f"{per['plain'] * 1e3:.3f} ms, with the checked one {per['checked'] * 1e3:.3f} ms: "
      f"{(per['checked'] - per['plain']) * 1e6:+.1f} us per --log-interval (100 steps by default); "
      f"the scan before each checkpoint {scan * 1e3:.2f} ms per epoch; the stop check "
      f"{(per['stoppable'] - per['step']) * 1e6:+.1f} us per step beside it, "
      f"{seconds(lambda: run.end_of_step(1, 1, totals), 100_000) * 1e6:.2f} us alone")  # fmt: skip
