"""Runs a hang-triage lab: `make lab N=1`, or python labs/run.py 1 [--diff] (labs/README.md).

A lab is stage 03's train.py with a few lines changed, patched at run time (labs/<n>_<name>/patch.py): each
change replaces, or goes before, the one line of train.py that holds its anchor, and a missing anchor is an
error naming it. The patched copy is written to runs/lab<n>.py (in runs/, one folder below the repository, it
finds common/ as the stage does), shown as a diff against the stage, and run on two gloo ranks on the CPU,
a small --dist-timeout bounding every wait. Then the lab's tools read what went wrong: `py-spy dump` of the
job while it hangs, the run's `error:` lines, or what each rank drew per epoch. A job still running 10 s after
its first `error:` line is ended with everything it started (the ranks, a session each, and their DataLoader
workers): nothing outlives the lab.
"""

import argparse
import difflib
import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / "03_ddp_single_node" / "train.py"
LABS = sorted(p.parent for p in (REPO / "labs").glob("[1-9]_*/patch.py"))
QUIET = 5  # seconds without output after the banner: py-spy looks, and again every QUIET s while it lasts
TIMEOUT = 20  # --dist-timeout: how long a collective waits
GRACE = 10  # seconds a job may take to end after its first error line
LIMIT = 75  # seconds a lab's job may run in all: --dist-timeout, start-up and the ending


def lab(number):
    """The folder of lab `number` and its patch module (PATCH, ARGS, TOOLS)."""
    found = [p for p in LABS if p.name.split("_")[0] == str(number)]
    if not found:
        sys.exit(f"error: no lab {number}: the labs are {', '.join(p.name for p in LABS)}")
    spec = importlib.util.spec_from_file_location(f"lab{number}", found[0] / "patch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return found[0], module


def patched(lines, patch, name):
    """`lines` with each (anchor, where, text) of `patch` applied: `text` replaces (where="replace") or goes
    before (where="before") the one line holding `anchor`, indented as it; "{line}" in `text` is that line.
    Before a `def`, the text goes above its decorators."""
    lines = list(lines)
    for anchor, where, text in patch:
        at = [i for i, line in enumerate(lines) if anchor in line]
        if len(at) != 1:
            many = f"{len(at)} lines hold" if at else "no line holds"
            sys.exit(f"error: {name}: {many} the anchor {anchor!r} in {STAGE.relative_to(REPO)}: the stage changed; "
                     f"update {name}/patch.py")  # fmt: skip
        i = at[0]
        line = lines[i]
        indent = line[: len(line) - len(line.lstrip())]
        new = [(indent + part if part else "") + "\n" for part in text.split("\n")]
        new = [n.replace("{line}", line.strip()) for n in new] if text else []
        if where == "before":
            while i and lines[i - 1].startswith(indent + "@"):
                i -= 1
            lines[i:i] = new
        else:
            lines[i : i + 1] = new
    return lines


def diff(before, after, name):
    return "".join(difflib.unified_diff(before, after, str(STAGE.relative_to(REPO)), name))


def options(folder, module, args):
    """train.py's options. The lab's own folder is emptied first (an earlier run's checkpoint
    would be refused); one given with --output-dir must not exist yet."""
    out = Path(args.output_dir or REPO / "runs" / "labs" / folder.name)
    if args.output_dir and out.exists():
        sys.exit(f"error: --output-dir {out} exists: give a new folder, the lab's run starts afresh")
    shutil.rmtree(out, ignore_errors=True)
    common = ["--no-cuda", "--dist-timeout", str(TIMEOUT), "--data-dir", str(args.data_dir)]
    return [*common, "--output-dir", str(out), *module.ARGS]


def end_all(pid):
    """SIGKILL to the process groups of `pid` and its descendants: torchrun, its ranks (a session each) and their
    DataLoader workers."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))  # (ppid, pgid)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            pass
    tree, grown = {pid}, True
    while grown:
        grown = {p for p, (ppid, _) in parents.items() if ppid in tree and p not in tree}
        tree |= grown
    for group in {parents[p][1] for p in tree if p in parents} | {pid}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def dump(pid):
    """py-spy's stacks of the job: torchrun, its ranks and their DataLoader workers."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return "py-spy is not installed: pip install py-spy (requirements.txt)\n"
    found = subprocess.run([spy, "dump", "--subprocesses", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    return found.stdout + found.stderr


def where(stacks, script):
    """For each process of py-spy's dump, its rank (RANK in its environment; a DataLoader worker has its rank's),
    and the innermost frame of its main thread in `script`, with that line of the script."""
    source, found = script.read_text().splitlines(), []
    for block in re.split(r"^Process ", stacks, flags=re.M)[1:]:
        pid = int(block.split(":", 1)[0])
        main = block.split('"MainThread"', 1)[-1].split("\nThread ", 1)[0]
        frame = re.search(rf"\({re.escape(script.name)}:(\d+)\)", main)
        try:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:
            env = {}
        if frame and "RANK" in env:
            worker = "'s DataLoader worker" if "_worker_loop" in main else ""
            who = f"rank {env['RANK']}{worker} (pid {pid})"
            line = int(frame[1])
            found.append(f"{who} waits at {script.parent.name}/{script.name}:{line}: {source[line - 1].strip()}")
    return "\n".join(found)


def launch(script, train_args, tools):
    """torchrun with two ranks, its output echoed and returned; with "py-spy" in `tools`, the last of py-spy's
    looks while the job was silent, and where each process waited."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    print(f"== {' '.join(['torchrun', *cmd[3:]])} {' '.join(train_args)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    job = subprocess.Popen([*cmd, *train_args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in job.stdout], daemon=True).start()
    output, stacks, places, last, began = [], None, "", time.monotonic(), False
    end = time.monotonic() + LIMIT
    looked = 0  # when py-spy last looked: it looks every QUIET seconds without output, and shows the last look
    failed = None  # when the first `error:` line came: the diagnosis is in; the job has GRACE seconds to end
    try:
        while job.poll() is None and time.monotonic() < end:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                quiet = time.monotonic() - max(last, looked)
                if "py-spy" in tools and began and not failed and quiet > QUIET:  # again while it is quiet
                    found, looked = dump(job.pid), time.monotonic()
                    if looked - last < TIMEOUT - 2:  # after that, a collective may have failed: no longer the hang
                        stacks, places = found, where(found, script)  # now: the ranks' environments name them
                continue
            print(line, end="", flush=True)
            output.append(line)
            last, began = time.monotonic(), began or "world size" in line
            if line.startswith("error:") and failed is None:
                failed, end = last, min(end, last + GRACE)
        if job.poll() is None:
            why = f"{GRACE} s after its first error line" if failed else f"after {LIMIT} s"
            print(f"== the job still runs {why}: ended (kill -9)", flush=True)
    finally:
        end_all(job.pid)
        job.wait()
    time.sleep(0.5)  # the reader's last lines
    while not lines.empty():
        line = lines.get()
        print(line, end="")
        output.append(line)
    if stacks:
        print(f"== py-spy dump --subprocesses --pid {job.pid}   (torchrun's pid; its last look while all waited)")
        print(stacks, flush=True)
        print(f"== where each process waited in {script.name} (py-spy's innermost frame there)")
        print(places or "(none)", flush=True)
    return "".join(output)


def drawn(output):
    """What each rank drew first in each epoch (lab 4's probe lines), compared."""
    seen = {}
    # two ranks' lines may interleave on one line of the log: each probe found wherever it stands
    for rank, epoch, labels in re.findall(r"rank (\d+) epoch (\d+) drew labels (\[[^\]]*\])", output):
        seen.setdefault(rank, {})[int(epoch)] = labels
    lines = []
    for rank, epochs in sorted(seen.items()):
        firsts = [epochs[e] for e in sorted(epochs)]
        if len(firsts) > 1 and len(set(firsts)) == 1:
            lines.append(f"rank {rank} drew the same first batch in epochs {', '.join(map(str, sorted(epochs)))}: "
                         "every epoch in one order (is sampler.set_epoch(epoch) called before each?)")  # fmt: skip
        elif len(firsts) > 1:
            lines.append(f"rank {rank} drew another first batch in each epoch: a new order every epoch")
    return "\n".join(lines) or "no probe lines: did the run reach a second epoch?"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("number", nargs="?", help="the lab (1-6); none: list them")
    p.add_argument("--diff", action="store_true", help="only show the lab's change to stage 03's train.py")
    p.add_argument("--data-dir", default=REPO / "data", help="as train.py's (default: data)")
    p.add_argument("--output-dir", help="the run's folder, emptied first (default: runs/labs/<lab>)")
    args = p.parse_args()
    if args.number is None:
        for folder in LABS:
            print(f"{folder.name.split('_')[0]}  {lab(folder.name.split('_')[0])[1].__doc__.splitlines()[0]}")
        return
    folder, module = lab(args.number)
    name = f"runs/lab{args.number}.py"
    stage = STAGE.read_text().splitlines(keepends=True)
    lines = patched(stage, module.PATCH, f"labs/{folder.name}")
    print(f"== lab {args.number}: {module.__doc__.splitlines()[0]} (labs/{folder.name}/README.md)")
    print(diff(stage, lines, name), end="", flush=True)
    if args.diff:
        return
    train_args = options(folder, module, args)
    script = REPO / name
    script.parent.mkdir(exist_ok=True)
    script.write_text("".join(lines))
    output = launch(script, train_args, module.TOOLS)
    if "drawn" in module.TOOLS:
        print("== what each rank drew first, epoch by epoch (the probe's lines)")
        print(drawn(output))
    print("== grep '^error:' (the run's one-line diagnosis)")
    print("\n".join(line for line in output.splitlines() if line.startswith("error:")) or "(none)")


if __name__ == "__main__":
    main()
