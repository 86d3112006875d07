"""The GPU table from a results.txt of measure.sh: each figure that matters, what it was measured from, and its target.
A run that is missing, failed or did not reach a figure shows "–" (QUICK=1 on a CPU, a section skipped)."""

import re
import statistics
import sys

RUN = re.compile(r"^(\w+) rc=(\d+) .*?img/s=(\d+) .*?compile=([\d.]+) t99=(\S+) .*?peakMiB=(\d+|nan)")
SEEDS = ["r1024", "r1024s2", "r1024s3", "r1024s4", "r1024s5"]
BEST = ["rc1", "rc2", "rc3", "rc4", "rc5"]  # the recipe section's best recipe, compiled


def parse(lines):
    """{run: {"ips", "compile", "t99", "peak"}} of the runs that ended well; {"wrn-D-W bB": {"DDP": MiB, "FSDP": MiB}}
    of the planner (weights + gradients + optimizer + gathered + activations: what max_memory_allocated sees); the
    resume and DDP profile lines; the first line's device and versions."""
    runs, plans, other, head = {}, {}, [], lines[0] if lines else ""
    for line in lines:
        if (m := RUN.match(line)) and m[2] == "0":
            t99 = None if m[5] == "-" else float(m[5])
            runs[m[1]] = dict(ips=int(m[3]), compile=float(m[4]), t99=t99, peak=float(m[6]))
        elif m := re.match(r"plan (wrn-\d+-\d+ b\d+): (.*)", line):
            for strategy, cells in re.findall(r"\| 1 \| (DDP|FSDP) \|((?: [\d.]+ MiB \|){5})", m[2]):
                plans.setdefault(m[1], {})[strategy] = sum(float(x) for x in re.findall(r"([\d.]+) MiB", cells))
        elif re.match(r"t0[35]: |ddp_profile rc=0|recipes rc=", line):
            other.append(line)
    return runs, plans, other, head.removeprefix("== start ").split(" | ", 1)[-1]


def ratio(runs, a, b, percent=False):
    """`a` over `b` in images/s: "a / b = r", or "–"."""
    if a not in runs or b not in runs:
        return "–"
    r = runs[a]["ips"] / runs[b]["ips"]
    shown = f"{100 * r:.0f} %" if percent else f"{r:.2f}×"
    return f"{runs[a]['ips']:,} / {runs[b]['ips']:,} = {shown}"


def compiled(runs, eager, compiled_run):
    text = ratio(runs, compiled_run, eager)
    return text if text == "–" else f"{text} ({runs[compiled_run]['compile']:.1f} s compiling)"


def time_to_99(runs, seeds=SEEDS):
    reached = [runs[s]["t99"] for s in seeds if s in runs and runs[s]["t99"] is not None]
    ran = [s for s in seeds if s in runs]
    if not reached:
        return f"not reached in {len(ran)} runs" if ran else "–"
    return f"{statistics.mean(reached):.2f} s, mean of {len(reached)} of {len(ran)} seeds ({', '.join(f'{t:.2f}' for t in reached)})"  # fmt: skip


def planner(runs, plans):
    errors = []
    for name, strategies in plans.items():
        d, w, b = re.match(r"wrn-(\d+)-(\d+) b(\d+)", name).groups()
        for strategy, mib in strategies.items():
            run = f"m_{strategy.lower()}_{d}_{w}_{b}"
            if run in runs and runs[run]["peak"] == runs[run]["peak"]:  # not nan: a GPU measured it
                errors.append(100 * (mib - runs[run]["peak"]) / runs[run]["peak"])
    return f"{min(errors):+.0f} % to {max(errors):+.0f} % over {len(errors)} runs" if errors else "–"


def resume(lines):
    done = {line[:3]: "saved at" in line and "resume rc=0" in line for line in lines if line.startswith("t0")}
    return (
        "; ".join(f"{k}: {'saved at a step, resumed' if ok else 'failed (logs.txt)'}" for k, ok in done.items()) or "–"
    )


def best(lines):
    """The flags recipes.py found best (the recipe section), or "–"."""
    return next((x.split(": best ", 1)[1] for x in lines if x.startswith("recipes rc=")), "–")


def ddp_step(lines):
    """ms per step of bench/ddp_profile.py: no DDP, DDP, DDP compiled."""
    line = next((x for x in lines if x.startswith("ddp_profile")), "")
    ms = re.findall(r"\| (no DDP|DDP as|torch.compile)[^|]*\| ([\d.]+) \|", line)
    return " / ".join(f"{t} ms" for _, t in ms) if ms else "–"


def table(lines):
    runs, plans, other, head = parse(lines)
    rows = [
        ("01 default vs pytorch/examples' classic pipeline, batch 64", ratio(runs, "p01", "classic"), "–"),
        ("03 at 1 rank vs 01, batch 64 (two rounds)",
         f"{ratio(runs, 'p03', 'p01', True)}; {ratio(runs, 'p03b', 'p01b', True)}", "≥ 95 %"),
        ("05 at 1 rank vs 03, batch 64", ratio(runs, "p05", "p03", True), "≥ 90 %"),
        ("05 vs 03, WideResNet-28-10, batch 128", ratio(runs, "m_fsdp_28_10_128", "m_ddp_28_10_128", True), "≥ 95 %"),
        ("`--compile` vs eager, 01 batch 64", compiled(runs, "p01", "p01c"), "≥ 2×"),
        ("`--compile` vs eager, 03 batch 64", compiled(runs, "p03", "p03c"), "≥ 1.5×"),
        ("`--compile` vs eager, 05 batch 64", compiled(runs, "p05", "p05c"), "≥ 1.5×"),
        ("`--compile` vs eager, the time-to-99 % recipe", compiled(runs, "r1024", "r1024c"), "–"),
        ("time to 99 % test accuracy, the recipe (RECIPE)", time_to_99(runs), "≤ 1.0 s, mean of 5 seeds"),
        (f"time to 99 %, the recipe search's best, compiled: {best(other)}", time_to_99(runs, BEST),
         "≤ 1.0 s, mean of 5 seeds"),
        ("planner vs measured peak (weights+grads+optimizer+gathered+activations)", planner(runs, plans), "within 15 %"),
        ("SIGTERM to every process of a torchrun step, 03 and 05, then `--resume`", resume(other), "–"),
        ("ms per step, batch 64: no DDP / DDP (as 03) / DDP then compile (bench/ddp_profile.py)", ddp_step(other), "–"),
    ]  # fmt: skip
    return "\n".join([head, "", "| what | measured | target |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])  # fmt: skip


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(f.read().splitlines()))
