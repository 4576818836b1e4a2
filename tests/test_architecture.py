"""The package's layers hold: import-linter's contracts (.importlinter) pass, they
bite when a lower layer imports a higher one, and no import cycle hides in function-level imports
(which import-linter counts too, but a walk of our own says which modules form the cycle)."""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "accel_train"
# Entry points may import lazily (keeps --help and one-line errors fast): their imports are
# left out of the cycle walk, as docs/architecture.md says.  The package itself hands out
# `accel_train.fit` lazily for the same reason.
LAZY_ALLOWED = ("accel_train.cli", "accel_train.commands")
LAZY_ROOT = "accel_train"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_imports(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (function level too),
    resolving relative imports and `from package import module`."""
    files = {module_name(p, root): p for p in (root / "accel_train").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def without_lazy_entry_points(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {name: (set() if name.startswith(LAZY_ALLOWED) or name == LAZY_ROOT else targets)
            for name, targets in graph.items()}


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.slow
def test_no_import_cycle_counting_function_level_imports():
    cycle = find_cycle(without_lazy_entry_points(package_imports(REPO)))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def imports_the_package(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith("accel_train")
    return any(alias.name.startswith("accel_train") for alias in node.names)


def test_only_entry_points_import_the_package_lazily():
    """A function-level import of the package's own modules outside cli.py and commands/ would
    be a way round a contract."""
    lazy = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path, REPO)
        if name.startswith(LAZY_ALLOWED) or name == LAZY_ROOT:
            continue
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level \
                    and imports_the_package(node):
                lazy.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not lazy, "function-level imports of accel_train: " + ", ".join(lazy)


def lint_imports() -> str:
    found = shutil.which("lint-imports")
    if found is None:
        pytest.skip("import-linter is not installed; it comes with the test extra: "
                    "pip install -e '.[test]'")
    return found


def test_import_linter_contracts_pass():
    result = subprocess.run([lint_imports()], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    contracts = configparser.ConfigParser()
    contracts.read(REPO / ".importlinter")
    kinds = {contracts[s]["type"] for s in contracts.sections()
             if s.startswith("importlinter:contract:")}
    assert {"layers", "independence"} <= kinds


@pytest.mark.parametrize("module, planted", [
    # the arrows that once made one circle of sixteen modules
    ("config.py", "from accel_train.model import build"),
    ("model/build.py", "from accel_train.data import loaders"),
    ("data/sources.py", "from accel_train.run import distributed"),
    ("base/readers.py", "from accel_train import config"),
])
def test_the_contracts_refuse_an_upward_import(tmp_path, module, planted):
    """The same contracts on a copy of the package with one forbidden arrow planted fail."""
    copy = tmp_path / "repo"
    shutil.copytree(PACKAGE, copy / "accel_train",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", copy / ".importlinter")
    target = copy / "accel_train" / module
    target.write_text(target.read_text() + f"\n{planted}  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    result = subprocess.run([lint_imports(), "--no-cache"], cwd=copy, capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "BROKEN" in result.stdout
