"""The stages teach through their diffs: each diff stays small, each file short."""

import ast
import difflib
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import HANG, REPO, S05, STAGES

TRAIN_BUDGETS = {("01_single_gpu", "02_dataparallel"): 12, ("02_dataparallel", "03_ddp_single_node"): 60,
                 ("03_ddp_single_node", "04_ddp_multi_node"): 10, ("04_ddp_multi_node", "05_fsdp"): 40}  # fmt: skip
JOB_SCRIPTS = sorted(REPO.glob("0*/*.slurm")) + sorted(REPO.glob("sweeps/*.slurm"))


FMT = re.compile(r"[ \t]*#[ \t]*fmt:[ \t]*(skip|off|on)\b.*$", re.M)  # the formatter's escapes


def ruff_format(folder):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    subprocess.run([ruff, "format", "--quiet", "."], cwd=folder, check=True, timeout=60)


@functools.cache
def formatted():
    """{path: text} of every stage's train.py and common/ module as the project's ruff formats it once every
    `fmt: skip`, `fmt: off` and `fmt: on` is removed: the budgets count what no squeezing can shorten."""
    paths = [REPO / stage / "train.py" for stage in STAGES] + sorted(REPO.glob("common/**/*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths + [REPO / "pyproject.toml", *REPO.glob("common/**/ruff.toml")]:
            copy = Path(tmp) / path.relative_to(REPO)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(FMT.sub("", path.read_text()))
        ruff_format(tmp)
        return {path: (Path(tmp) / path.relative_to(REPO)).read_text() for path in paths}


def test_a_squeezed_line_counts_as_the_lines_it_formats_to(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    escape = "# fmt" + ": skip"  # written apart, so that this file holds none
    squeezed = f"x = dict(a=1, b=2, c=3, d=4, e=5, f=6, g=7, h=8, i=9, j=10, k=11, l=12, m=13, n=14, o=15, p=16, q=17, r=18)  {escape}\n"
    (tmp_path / "f.py").write_text(FMT.sub("", squeezed))
    ruff_format(tmp_path)
    assert len((tmp_path / "f.py").read_text().splitlines()) > 1 and FMT.search(squeezed)
    assert len(formatted()) == len(STAGES) + len(list(REPO.glob("common/**/*.py")))


def code(path):
    """A train.py without its opening docstring, formatted: the budgets count code, not the stage's description."""
    text = formatted()[path]
    first = ast.parse(text).body[0]
    skip = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return text.splitlines()[skip:]


def changed_lines(a, b):
    """What `diff a b | grep -c '^[<>]'` counts."""
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


@pytest.mark.parametrize(
    "pair, budget", TRAIN_BUDGETS.items(), ids=lambda p: "->".join(p) if isinstance(p, tuple) else ""
)
def test_train_py_diff_budget(pair, budget):
    a, b = (code(REPO / stage / "train.py") for stage in pair)
    assert changed_lines(a, b) <= budget


@pytest.mark.parametrize("stage", STAGES)
def test_train_py_length(stage):
    assert len(formatted()[REPO / stage / "train.py"].splitlines()) <= 170


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_job_script_length(script):
    assert len(script.read_text().splitlines()) <= 60


def test_every_stage_has_its_files():
    for stage in STAGES:
        assert {"train.py", "job.slurm", "README.md"} <= {p.name for p in (REPO / stage).iterdir()}, stage
    assert (REPO / "04_ddp_multi_node/job_torchrun.slurm").exists()


def test_changed_lines_counts_like_diff():
    assert changed_lines(["a", "b", "c"], ["a", "x", "c", "d"]) == 3  # one changed (<, >), one added (>)


def test_the_readme_reads_in_one_sitting():
    """The README points the way (what to read first, how to run it); the details live beside their code."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


PROJECTED = [REPO / stage / "train.py" for stage in STAGES] + sorted(
    path for path in REPO.glob("common/**/*.py") if "guards" not in path.relative_to(REPO).parts
)


def test_the_stages_and_their_diffs_fit_a_projector():
    """A stage's train.py, the lesson's modules (common/ but its guard rails, the tasks too) and
    `make diff` (tools/stage_diff.py) are read on a projector: no line wider than 100 columns. (A diff line carries one character more
    than its file's line.)"""
    wide = [f"{path.relative_to(REPO)}:{number}: {len(line)}" for path in PROJECTED
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]  # fmt: skip
    shown = subprocess.run(
        [sys.executable, "tools/stage_diff.py"], cwd=REPO, capture_output=True, text=True, timeout=HANG
    )
    assert shown.returncode == 0 and shown.stdout.count("\n==== ") == 5, shown.stderr
    wide += [f"make diff: {line}" for line in shown.stdout.splitlines() if len(line) > 100]
    assert len(PROJECTED) > 5 and wide == []


LESSON_AND_TOOLS = sorted(REPO.glob("common/**/*.py")) + sorted(REPO.glob("tools/*.py"))


@pytest.mark.parametrize("path", sorted(REPO.glob("common/**/*.py")), ids=lambda p: p.relative_to(REPO).as_posix())
def test_common_modules_read_in_minutes(path):
    """A learner follows a stage into common/: each module fits a few screens, as the formatter writes it."""
    assert len(formatted()[path].splitlines()) <= 250


@pytest.mark.parametrize("path", LESSON_AND_TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_function_is_longer_than_a_screen(path):
    functions = [f for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)]
    assert [(f.name, f.end_lineno - f.lineno + 1) for f in functions if f.end_lineno - f.lineno + 1 > 60] == []


def exits(tree):
    """The lines that end the process: SystemExit, sys.exit, os._exit, exit() (under any name imported)."""
    imported = [a for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in ("sys", "os")
                for a in n.names if a.name in ("exit", "_exit")]  # fmt: skip
    named = {"SystemExit", "exit", "quit"} | {a.asname or a.name for a in imported}
    qualified = {("sys", "exit"), ("os", "_exit")}
    return [n.lineno for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id in named)
            or (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and (n.value.id, n.attr) in qualified)]  # fmt: skip


def test_the_lesson_raises_ordinary_exceptions():
    """The lesson refuses a value, an object or a file with an ordinary exception (ValueError,
    TypeError, FileNotFoundError); the guard rails turn it into one line (failure.refusal())."""
    lesson = [p for p in REPO.glob("common/**/*.py") if "guards" not in p.relative_to(REPO).parts]
    found = {p.relative_to(REPO).as_posix(): exits(ast.parse(p.read_text())) for p in lesson}
    assert len(lesson) > 10 and {path: lines for path, lines in found.items() if lines} == {}
    sample = "import sys\nfrom os import _exit as bye\nsys.exit(1)\nraise SystemExit\nbye(1)\nexit()"
    assert sorted(exits(ast.parse(sample))) == [3, 4, 5, 6]


def test_setup_shows_the_process_group_and_nothing_else():
    """The module a learner reads for setup() holds no thread, no store and no hook: the guard rails are in
    modules of their own (common/guards/watchdog.py, common/guards/preflight.py)."""
    text = (REPO / "common/distributed.py").read_text()
    assert "init_process_group" in text
    for hidden in ("threading", "excepthook", "TCPStore"):
        assert hidden not in text, hidden


def test_values_travel_as_arguments_not_through_the_environment():
    writes = [(p.name, line.strip()) for p in REPO.glob("common/**/*.py") for line in p.read_text().splitlines()
              if re.search(r"os\.environ(\[[^]]+\]\s*=[^=]|\.update\(|\.setdefault\()", line)]  # fmt: skip
    assert writes == []


def test_all_of_the_sharding_is_in_the_stage():
    """fully_shard is called in stage files only, where the 04 -> 05 diff shows it."""
    calls = [p.relative_to(REPO).as_posix() for p in LESSON_AND_TOOLS if "fully_shard(" in p.read_text()]
    assert calls == [] and "fully_shard(" in (S05).read_text()


def test_the_lesson_reads_in_one_sitting():
    """tools/reading_path.py: the lesson lines a learner reaches from each stage, the guard-rail call sites in
    each train.py, setup()'s length and reach, no lesson module importing a guard rail, no module-level state."""
    out = subprocess.run(
        [sys.executable, "tools/reading_path.py"], cwd=REPO, capture_output=True, text=True, timeout=HANG
    )
    assert out.returncode == 0 and out.stdout.endswith("all limits hold\n"), out.stdout


def test_the_reading_path_tool_refuses_what_it_does_not_take():
    """`--bogus` (or `--jsn`) ran the whole report and exited 0; `--help` did too."""
    run = lambda *argv: subprocess.run([sys.executable, "tools/reading_path.py", *argv], cwd=REPO,  # noqa: E731
                                       capture_output=True, text=True, timeout=HANG)  # fmt: skip
    bogus, helped = run("--raw", "--jsn"), run("--help")
    assert (
        bogus.returncode == 1 and bogus.stderr == "error: tools/reading_path.py takes --json and --raw alone: --jsn\n"
    )
    assert not bogus.stdout and helped.returncode == 0 and helped.stdout.startswith("What a learner reads")


HOLDERS = {"totals", "sums", "cut", "carry", "position", "so_far"}  # have held an epoch's sums


def held(node):
    """The name a subscript reads from: `totals`, `self.cut`, `state["run"]["cut"]`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    return None


def by_position(index):
    """An integer index, or a slice with integer bounds: a position, not a name."""
    if isinstance(index, ast.Slice):
        return any(by_position(bound) for bound in (index.lower, index.upper) if bound is not None)
    return isinstance(index, ast.Constant) and type(index.value) is int


def test_an_epochs_sums_are_read_by_name():
    """metrics.Sums and metrics.Epoch name what an epoch adds up; the stages, the lesson and the
    guard rails read them by name, never by a position that each of them would decode on its own."""
    paths = sorted(REPO.glob("common/**/*.py")) + [REPO / stage / "train.py" for stage in STAGES]
    nodes = [(path, node) for path in paths for node in ast.walk(ast.parse(path.read_text()))]
    indexed = [(path, node) for path, node in nodes if isinstance(node, ast.Subscript)]
    found = [f"{path.relative_to(REPO)}:{node.lineno}" for path, node in indexed
             if held(node.value) in HOLDERS and by_position(node.slice)]  # fmt: skip
    assert found == []


def reached(stage):
    """The lesson definitions ("module:name") tools/reading_path.py counts for `stage`."""
    spec = importlib.util.spec_from_file_location("reading_path", REPO / "tools" / "reading_path.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    project = tool.Project(REPO)
    tree = ast.parse((REPO / stage / "train.py").read_text())
    used = project.refs(tree, None, project.imported(tree, None))
    used |= {k for k in project.defs if k.split(":")[0] == tool.DEFAULT_TASK}  # task.model(), task.datasets()
    return project.reach(used, True)


def test_following_the_default_task_reaches_the_model_it_trains_alone():
    """task.model() leads to MNIST's model through models.build() and its table of models: a learner does not
    read the other models on the way, nor the checks that distrust a data file."""
    seen = reached("01_single_gpu")
    assert "common.models:build" in seen and "common.datafiles:read_idx" in seen
    others = {"common.models:WideResNet", "common.models:Block", "common.models:CNN"}
    assert seen & others == set()


def literal(node):
    """A number written out (15, 3 + 12): a bound no busy machine is held to."""
    if isinstance(node, ast.BinOp):
        return literal(node.left) and literal(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float))


def clocks(path):
    """`file:line: test` for each wall-clock bound (`elapsed < 15`, `time.monotonic() - start < 30`) asserted in a
    test of the everyday suite (not marked slow or slurm, itself or its module), and each process given under 120 s
    (`timeout=30`): beside two other trainings a 10 s run took over 60."""
    source = path.read_text()
    if re.search(r"^pytestmark\s*=.*(slow|slurm)", source, re.M):
        return []
    found = []
    for test in ast.walk(ast.parse(source)):
        if not isinstance(test, ast.FunctionDef) or not test.name.startswith("test_"):
            continue
        if {"pytest.mark.slow", "pytest.mark.slurm"} & {ast.unparse(d) for d in test.decorator_list}:
            continue  # a test with a slow case of its parameters still runs its others here
        for wait in (n for n in ast.walk(test) if isinstance(n, ast.keyword) and n.arg == "timeout"):
            if literal(wait.value) and eval(ast.unparse(wait.value)) < 120:  # a hang net (helpers.HANG), not a clock
                found.append(f"{path.name}:{wait.value.lineno}: {test.name} timeout={ast.unparse(wait.value)}")
        for check in (n for n in ast.walk(test) if isinstance(n, ast.Assert)):
            for compare in (n for n in ast.walk(check.test) if isinstance(n, ast.Compare)):
                timed = re.search(r"seconds|monotonic|perf_counter|time\.time", ast.unparse(compare.left))
                if timed and any(isinstance(op, (ast.Lt, ast.LtE)) for op in compare.ops):
                    if literal(compare.comparators[-1]):
                        found.append(f"{path.name}:{check.lineno}: {test.name}")
    return found


def test_the_everyday_suite_holds_no_clock_a_busy_machine_breaks():
    """`make test` from a fresh clone beside two other trainings on 2 cores failed two tests on a clock (rank 0 in
    under 20 s, a refusal in under 15 s): a bound in `make test` is relative (below a --dist-timeout set far above
    it, a named constant), or its order shows in the output, or the test is slow."""
    assert [c for path in sorted((REPO / "tests").glob("test_*.py")) for c in clocks(path)] == []
