#!/usr/bin/env python3
"""What a learner reads: the lines of common/ that a stage's train.py reaches, on three floors.

Run from the project's root:  python3 tools/reading_path.py [--json] [--raw]   (tests/test_budgets.py runs it)

common/ has three floors. The guard rails are the modules of a package inside common/ whose name contains
"guard" (common/guards/); the options are those of a package whose name contains "option" (common/options/):
what a flag turns on, read when it is used; the lesson is the rest of common/ (its modules, and those of any
other package inside it, such as the built-in tasks): what a default run needs. Lines are counted as the
formatter writes them: the tool formats a copy of common/ with the project's ruff (found as `ruff`, or in
.venv/bin) after removing every `# fmt: skip`, `# fmt: off` and `# fmt: on`, so that squeezing code onto
fewer lines changes no count; --raw, or no ruff, counts the files as they are (and says so).
From each stage's train.py it follows every name of common/ that the script uses (and, where it calls
task.model() or task.datasets(), the default task's definitions, which are loaded by path), then every name of
common/ that those definitions use, and so on, and adds up the lines of the definitions reached (a
function's or class's lines, decorators and docstring included). It reports, per stage:

  lesson   the definitions reached through lesson modules only (a guard-rail or option definition is
           neither counted nor followed): what a learner must read to understand the stage
  guards   the call sites in train.py of guard-rail names and of a guard object's methods (a name containing
           "guard"): the visible lines a learner may skip
  options  the call sites in train.py of option names: the visible lines where a flag's code is entered
  all      everything reached, guard rails and options included

and, for the project: lesson modules that import a guard-rail or option module (the lesson must not stand on
either), the largest lesson module, setup()'s length and reach, and module-level mutable state (lower-case
names bound to a dict, list, set, lock or thread at module level, and `global` statements) anywhere in common/.
It reads the code as text (ast) and runs nothing. Exit status 1 if a limit below is broken.
"""

import ast
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = ["01_single_gpu", "02_dataparallel", "03_ddp_single_node", "04_ddp_multi_node", "05_fsdp"]
# lesson lines reached from train.py (formatted), per stage, the default task's model and data included: the
# ceiling today's code holds, lowered as the lesson shrinks, never raised; the aim is TARGETS
LIMITS = {
    "01_single_gpu": 450,
    "02_dataparallel": 450,
    "03_ddp_single_node": 461,
    "04_ddp_multi_node": 461,
    "05_fsdp": 619,
}
TARGETS = {
    "01_single_gpu": 380,
    "02_dataparallel": 380,
    "03_ddp_single_node": 420,
    "04_ddp_multi_node": 420,
    "05_fsdp": 620,
}
GUARD_CALLS = 8  # guard-rail call sites in one train.py: calls of guard-rail names and of methods of a guard object
OPTION_CALLS = 10  # option call sites in one train.py
LESSON_MODULE_LINES = 200  # the longest lesson module (formatted)
DEFAULT_TASK = "common.tasks.images"  # the task a stage trains without --task, loaded by path
SETUP_LINES, SETUP_REACH = 25, 100
MUTABLE_CALLS = {"dict", "list", "set", "Lock", "RLock", "Event", "Thread", "local", "defaultdict", "deque"}


def module_name(root, path):
    return ".".join(path.relative_to(root).with_suffix("").parts)  # common.data, common.guards.lock


FMT = re.compile(r"[ \t]*#[ \t]*fmt:[ \t]*(skip|off|on)\b.*$", re.M)  # the formatter's escapes, removed


def formatted(root, raw):
    """path -> text of each common/ file as the project's ruff formats it, its fmt escapes removed; and a note"""
    files = sorted((root / "common").rglob("*.py"))
    texts = {p: p.read_text() for p in files}
    ruff = shutil.which("ruff") or next((str(x) for x in (root / ".venv/bin/ruff",) if x.exists()), None)
    if raw or not ruff:
        return texts, "raw lines" + ("" if raw else " (no ruff found: squeezed lines count as they are)")
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        for cfg in [root / "pyproject.toml", root / "ruff.toml", *(root / "common").rglob("ruff.toml")]:
            if cfg.is_file():
                (copy / cfg.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(cfg, copy / cfg.relative_to(root))
        for p, text in texts.items():
            (copy / p.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            (copy / p.relative_to(root)).write_text(FMT.sub("", text))
        done = subprocess.run([ruff, "format", "--quiet", "common"], cwd=copy, capture_output=True, text=True)
        if done.returncode:
            return texts, f"raw lines (ruff format failed: {done.stderr.strip()[:200]})"
        return {p: (copy / p.relative_to(root)).read_text() for p in files}, "lines as formatted, fmt escapes removed"


class Project:
    def __init__(self, root, raw=False):
        self.root = root
        texts, self.counted = formatted(root, raw)
        self.modules = {
            module_name(root, p): p for p in texts if p.name != "__init__.py" or p.parent != root / "common"
        }
        floor = {m: p.relative_to(root / "common").parts[:-1] for m, p in self.modules.items()}
        self.guard = {m for m, parts in floor.items() if any("guard" in part for part in parts)}
        self.option = {m for m, parts in floor.items() if any("option" in part for part in parts)} - self.guard
        self.texts = {m: texts[p] for m, p in self.modules.items()}
        self.trees = {m: ast.parse(t) for m, t in self.texts.items()}
        self.defs = {}  # "module:name" -> lines
        for m, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                    self.defs[f"{m}:{node.name}"] = node.end_lineno - start + 1
        self.uses = {}
        for m, tree in self.trees.items():
            names = self.imported(tree, m)
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.uses[f"{m}:{node.name}"] = self.refs(node, m, names) - {f"{m}:{node.name}"}

    def package_of(self, m):
        return m.rsplit(".", 1)[0] if "." in m else m

    def imported(self, tree, here):
        """local name -> ("mod", module) or ("def", "module:name"), for names bound from common/ anywhere in tree"""
        names = {}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.split(".")[0] == "common"
            ):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    names[a.asname or a.name] = (
                        ("mod", full) if full in self.modules else ("def", f"{node.module}:{a.name}")
                    )
            elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative import inside a package
                base = here.split(".")[: -node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    names[a.asname or a.name] = ("mod", full) if full in self.modules else ("def", f"{mod}:{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "common" and a.name in self.modules and a.asname:
                        names[a.asname] = ("mod", a.name)
        return names

    def refs(self, node, here, names):
        out, local = set(), set()
        for n in ast.walk(node):
            if isinstance(n, ast.arg):
                local.add(n.arg)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                local.add(n.id)
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute):
                chain = []
                v = n
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id in names and names[v.id][0] == "mod":
                    mod = names[v.id][1]
                    for attr in reversed(chain):  # common.guards.lock.claim written out
                        if f"{mod}.{attr}" in self.modules:
                            mod = f"{mod}.{attr}"
                        else:
                            out.add(f"{mod}:{attr}")
                            break
            if isinstance(n, ast.Name) and n.id in names and names[n.id][0] == "def":
                out.add(names[n.id][1])
            elif isinstance(n, ast.Name) and here and f"{here}:{n.id}" in self.defs and n.id not in local:
                out.add(f"{here}:{n.id}")
        return {k for k in out if k in self.defs}

    def reach(self, start, lesson_only):
        seen, todo = set(), [k for k in start if not (lesson_only and self.upstairs(k))]
        seen.update(todo)
        while todo:
            for k in self.uses.get(todo.pop(), ()):
                if k not in seen and not (lesson_only and self.upstairs(k)):
                    seen.add(k)
                    todo.append(k)
        return seen

    def is_guard(self, key):
        return key.split(":")[0] in self.guard

    def is_option(self, key):
        return key.split(":")[0] in self.option

    def upstairs(self, key):  # a guard rail or an option: not the lesson
        return self.is_guard(key) or self.is_option(key)

    def stage(self, name):
        path = self.root / name / "train.py"
        tree = ast.parse(path.read_text())
        names = self.imported(tree, None)
        used = self.refs(tree, None, names)
        guard_sites = option_sites = 0
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            if self.refs(n.func, None, names) & {k for k in used if self.is_option(k)}:
                option_sites += 1
            receiver = n.func.value if isinstance(n.func, ast.Attribute) else None
            while isinstance(receiver, ast.Attribute):
                receiver = receiver.value
            on_guard_object = (
                isinstance(receiver, ast.Name)
                and "guard" in receiver.id.lower()
                and not (receiver.id in names and names[receiver.id][0] == "mod")
            )
            if on_guard_object or self.refs(n.func, None, names) & {k for k in used if self.is_guard(k)}:
                guard_sites += 1
        # the default task is loaded by path (cli), not imported: a stage that calls task.model()/task.datasets()
        # reaches the default task's definitions as a learner does ("where is the model?")
        if any(
            isinstance(n, ast.Attribute)
            and n.attr in ("model", "datasets")
            and isinstance(n.value, ast.Name)
            and n.value.id == "task"
            for n in ast.walk(tree)
        ):
            used |= {k for k in self.defs if k.split(":")[0] == DEFAULT_TASK}
        lesson, everything = self.reach(used, True), self.reach(used, False)
        return {
            "lesson": sum(self.defs[k] for k in lesson),
            "lesson_modules": sorted({k.split(":")[0] for k in lesson}),
            "guard_calls": guard_sites,
            "option_calls": option_sites,
            "all": sum(self.defs[k] for k in everything),
            "all_modules": len({k.split(":")[0] for k in everything}),
        }

    def lesson_imports_upstairs(self):
        bad, upstairs = [], self.guard | self.option
        for m, tree in self.trees.items():
            if m in upstairs:
                continue
            for kind, target in self.imported(tree, m).values():
                mod = target if kind == "mod" else target.split(":")[0]
                if mod in upstairs or any(g.startswith(mod + ".") for g in upstairs) and mod != "common":
                    bad.append(f"{m} imports {target.replace(':', '.')}")
        return sorted(set(bad))

    def largest_lesson_module(self):
        lesson = {m: len(t.splitlines()) for m, t in self.texts.items() if m not in self.guard | self.option}
        m = max(lesson, key=lesson.get)
        return m, lesson[m]

    def state(self):
        bad = []
        for m, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    value = node.value
                    mutable = isinstance(
                        value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
                    ) or (
                        isinstance(value, ast.Call)
                        and (getattr(value.func, "attr", None) or getattr(value.func, "id", None)) in MUTABLE_CALLS
                    )
                    for t in targets:
                        if mutable and isinstance(t, ast.Name) and not t.id.isupper():
                            bad.append(f"{self.modules[m].relative_to(self.root)}:{node.lineno} {t.id}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Global):
                    bad.append(f"{self.modules[m].relative_to(self.root)}:{node.lineno} global {', '.join(node.names)}")
        return bad

    def setup(self):
        keys = [k for k in self.defs if k.endswith(":setup") and not self.is_guard(k)]
        if not keys:
            return None
        k = keys[0]
        return {
            "where": k,
            "lines": self.defs[k],
            "reach": sum(self.defs[x] for x in self.reach([k], True)),
            "reach_all": sum(self.defs[x] for x in self.reach([k], False)),
        }


def main():
    root = Path.cwd()
    p = Project(root, raw="--raw" in sys.argv)
    largest = p.largest_lesson_module()
    report = {
        "counted": p.counted,
        "stages": {s: p.stage(s) for s in STAGES if (root / s / "train.py").is_file()},
        "guard_modules": sorted(p.guard),
        "option_modules": sorted(p.option),
        "lesson_imports_upstairs": p.lesson_imports_upstairs(),
        "largest_lesson_module": largest,
        "setup": p.setup(),
        "module_state": p.state(),
        "common_lines": sum(len(t.splitlines()) for t in p.texts.values()),
    }
    fail = []
    if not p.guard:
        fail.append("no guard-rail package inside common/ (a package whose name contains 'guard')")
    if report["lesson_imports_upstairs"]:
        fail.append(f"lesson modules import guard rails or options: {report['lesson_imports_upstairs']}")
    if largest[1] > LESSON_MODULE_LINES:
        fail.append(f"lesson module {largest[0]} has {largest[1]} lines (limit {LESSON_MODULE_LINES})")
    for s, r in report["stages"].items():
        if r["lesson"] > LIMITS[s]:
            fail.append(f"{s} reaches {r['lesson']} lesson lines (limit {LIMITS[s]})")
        if r["guard_calls"] > GUARD_CALLS:
            fail.append(f"{s} calls the guard rails at {r['guard_calls']} places (limit {GUARD_CALLS})")
        if r["option_calls"] > OPTION_CALLS:
            fail.append(f"{s} enters options at {r['option_calls']} places (limit {OPTION_CALLS})")
    su = report["setup"]
    if not su or su["lines"] > SETUP_LINES or su["reach"] > SETUP_REACH:
        fail.append(f"setup(): {su} (limits {SETUP_LINES} lines, {SETUP_REACH} reached)")
    if report["module_state"]:
        fail.append(f"module-level state: {report['module_state']}")
    report["falls_short"] = fail
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
    else:
        print(f"counted: {p.counted}")
        for s, r in report["stages"].items():
            print(
                f"{s}: lesson {r['lesson']} lines in {len(r['lesson_modules'])} modules (limit {LIMITS[s]}, aim {TARGETS[s]}); "
                f"guard-rail calls {r['guard_calls']} (limit {GUARD_CALLS}), option calls {r['option_calls']} "
                f"(limit {OPTION_CALLS}) in train.py; all reached {r['all']} lines in {r['all_modules']} modules"
            )
        print(
            f"floors: {len(p.guard)} guard-rail modules, {len(p.option)} option modules; lesson modules importing "
            f"either: {report['lesson_imports_upstairs'] or 'none'}; largest lesson module {largest[0]} "
            f"{largest[1]} lines (limit {LESSON_MODULE_LINES})"
        )
        print(f"setup(): {su}")
        print(f"module-level state: {report['module_state'] or 'none'}; common/ {report['common_lines']} lines")
        print("falls short: " + "; ".join(fail) if fail else "all limits hold")
    sys.exit(1 if fail else 0)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # its help is its docstring
        sys.exit(print(__doc__))
    if unknown := [arg for arg in sys.argv[1:] if arg not in ("--json", "--raw")]:  # a typo ran the whole report
        sys.exit(f"error: tools/reading_path.py takes --json and --raw alone: {' '.join(unknown)}")
    main()
