"""The house has layers: no module of the project imports (at the top or inside a function) a module that
imports it back, directly or through others. The core (delta_gpt.py, data/, errors.py) sits at the bottom,
plumbing/ under train.py, and the workbench, sample.py and cli.py above it."""
import ast

from conftest import ROOT
from exercises.check import CHECKS

STUDENT_FILES = {f"exercises.{name}" for name in CHECKS}

PROJECT = ("cli", "delta_gpt", "errors", "sample", "train", "data", "plumbing", "workbench", "exercises")


def modules():
    """{dotted name: path} of every module of the project (a package's __init__ under the package's name),
    less the files a student writes (exercises/NAME.py): half-written, they need not even parse."""
    found = {}
    for path in sorted(ROOT.glob("*.py")) + sorted(ROOT.glob("*/*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if name.split(".")[0] in PROJECT and name not in STUDENT_FILES:
            found[name] = path
    return found


def imports(name, path, known):
    """The project modules that module `name` imports anywhere in its text (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, inside a package
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert {"train", "plumbing.config", "workbench.compare", "data.dataset"} <= set(graph)  # the scan sees the house

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if a in reach(b))
    assert not circles, "import circles: " + "; ".join(circles)


def test_the_layers_point_down():
    graph = {name: imports(name, path, modules()) for name, path in modules().items()}
    core = [n for n in graph if n in ("delta_gpt", "errors") or n.split(".")[0] == "data"]
    for name in core:  # the core imports nothing of the house but itself and errors.py
        assert all(t == "errors" or t.split(".")[0] == "data" for t in graph[name]), (name, graph[name])
    for name in [n for n in graph if n.startswith("plumbing")] + ["train"]:  # below the workbench
        assert not {t for t in graph[name] if t.split(".")[0] in ("workbench", "sample", "cli", "train")}, name


def test_python_train_py_loads_train_py_once():
    # as __main__ only: nothing it imports imports `train` back (which would run the file a second time)
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert out.returncode == 0 and "usage: python train.py" in out.stdout
    assert "plumbing.config" in imported and "train" not in imported
