"""The package's layers: no import circles (counting imports inside functions), algorithms that
know nothing of the loops that drive them, and ``import distrain`` without the optional extras."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "distrain"
#: Layers that distrain's own loop, the launchers and wrap() are built on: none imports those.
LOWER = ("algorithms", "comm", "compress", "runtime", "optim", "emulation", "data", "models")
UPPER = ("distrain.train", "distrain.launch", "distrain.distributed", "distrain.cli", "distrain.compare",
         "distrain.baselines", "distrain.bench", "distrain.report")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str) -> set[str]:
    """The distrain modules ``name`` imports anywhere (inside functions too), except for type
    checking only."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for node in ast.walk(stmt)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: imported(name) for name in MODULES}


def test_no_module_imports_a_module_that_imports_it_back():
    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            current = todo.pop()
            if current == goal:
                return True
            if current not in seen:
                seen.add(current)
                todo.extend(GRAPH[current])
        return False

    circles = sorted((a, b) for a, deps in GRAPH.items() for b in deps if a < b and reaches(b, a))
    assert circles == []


def test_the_graph_sees_imports_inside_functions():
    # launch/common's run_role imports the loop inside the function: the graph must count it.
    assert "distrain.train.loop" in GRAPH["distrain.launch.common"]


def test_lower_layers_import_no_loop_launcher_or_front_end():
    wrong = sorted((a, b) for a, deps in GRAPH.items() for b in deps
                   if a.count(".") and a.split(".")[1] in LOWER and b.startswith(UPPER))
    assert wrong == []


def test_algorithms_import_no_config_not_even_for_its_type():
    # An algorithm takes a settings dataclass; distrain.assemble alone turns flags into settings.
    wrong = []
    for name, path in MODULES.items():
        if name.startswith("distrain.algorithms"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                wrong += [(name, m) for m in modules if m == "distrain.config"]
    assert wrong == []


def test_import_distrain_loads_no_optional_extra_and_no_algorithm():
    code = ("import sys, distrain\n"
            "heavy = [m for m in ('matplotlib', 'sklearn', 'mnist1d', 'yaml', 'torchft', 'distrain.algorithms') if m in sys.modules]\n"
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == ""
    timed = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "distrain" in timed and not {"matplotlib", "sklearn", "mnist1d"} & set(timed)


def test_distrain_version_answers_without_torch():
    """``distrain --version`` (the console script runs distrain.cli:main) imports no torch: it
    took 5 to 7 s here when it did."""
    code = ("import sys\nfrom distrain.cli import main\n"
            "assert main(['--version']) == 0\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    from distrain import __version__

    assert done.stdout.split() == ["distrain", __version__, "False"]
