"""Guard rail: what a task is made of. A run records its task by the bytes it runs (preflight.defining()): the task's
file, and each module of its author's own that it imports (neither Python's, an installed package's nor common/'s),
and theirs in turn. A helper changed between a run and its resume makes another task, as a change to the task's file
does: it was resumed silently, with another activation or another label smoothing, and other numbers."""

import ast
import importlib.util
import sys
import sysconfig
import types
from pathlib import Path

from common.guards.bounded import regular_file

COMMON = Path(__file__).resolve().parent.parent  # the project's own modules: a task's imports of them are not its own
INSTALLED = {"site-packages", "dist-packages"}  # a package's, pip's or the system's


def with_own_modules(task):
    """The task's bytes, then each of its author's modules it imports, by file name and bytes. They are found in its
    import statements wherever they stand (one inside a function runs later, or never: `import helper` in loss()),
    in those of each module found, and in what the task holds (a class defined in a helper: its __module__)."""
    held = {
        v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", "") for v in vars(task).values()
    }
    todo = [*imports(task.__source__, ""), *(n for n in held if isinstance(n, str) and n != task.__name__)]
    found, seen = {}, set()  # {path: bytes} of the author's modules; the names looked at
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if (path := own_file(name)) is None or path in found:
            continue
        found[path] = regular_file(path).read_bytes()
        todo += imports(found[path], name if path.name == "__init__.py" else name.rpartition(".")[0])
    return task.__source__ + b"".join(path.name.encode() + found[path] for path in sorted(found))


def imports(source, package):
    """The modules the import statements of `source` (a module of `package`: "" for the task) may load: `import a.b`
    a and a.b, `from a import b` a and a.b (b may be a module); relative ones within `package`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python: the task's import says so when it runs
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except (ImportError, ValueError):  # beyond the top package: the import fails itself
                    continue
            names += [base] + [f"{base}.{alias.name}" for alias in node.names if base and alias.name != "*"]
    return [".".join(parts[:i]) for name in names if (parts := name.split(".")) for i in range(1, len(parts) + 1)]


def own_file(name):
    """The .py file of module `name` where it is its author's own, else None. A dotted name is looked up only below
    a package of the author's own (which finding it imports, as the task's import would): never an installed one."""
    parent = name.rpartition(".")[0]
    if not name or parent and own_file(parent) is None:
        return None
    try:
        module = sys.modules.get(name)
        origin = (
            getattr(module, "__file__", None) if module else getattr(importlib.util.find_spec(name), "origin", None)
        )
    except Exception:  # none there, or a package that fails to import: the task's own import says why
        return None
    if not isinstance(origin, str) or not origin.endswith(".py"):
        return None
    path = Path(origin)
    roots = (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"))
    if origin.startswith(roots) or COMMON in path.resolve().parents or INSTALLED & set(path.parts):
        return None
    return path if path.is_file() else None
