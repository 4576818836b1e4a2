"""Every third-party package the product imports is declared in setup.cfg: a fresh
`pip install accel_train` must not fail at an import that only this machine's environment
happened to satisfy.

Oracles: setup.cfg's own lists, and importlib.metadata.packages_distributions() (which installed
distribution provides each import name).  Every `import` and `from ... import` in accel_train/ is
read with ast, at module level and inside functions, and so are `importlib.import_module("x")`
calls with a literal name (a name computed at run time cannot be seen here).

Which lists may declare what:
- install_requires: anything the product imports, anywhere.
- the extras in OPTIONAL_EXTRAS: only inside functions (a plain install lacks them, so the
  module that imports one must still import without it).  `onnx`: `export --format onnx`'s
  exporter and its ONNX Runtime check; `torchcodec`: the JPEG decoder where torchvision has
  none left.
- `test`: never; the product must not need the test tools.
"""

from __future__ import annotations

import ast
import configparser
import functools
import re
import shutil
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIONAL_EXTRAS = ("onnx", "torchcodec")


@functools.lru_cache(maxsize=1)
def _providers() -> dict:
    return packages_distributions()  # (reads every installed distribution's file list: slow)


def _distribution(requirement: str) -> str:
    """A requirement line's project name, normalized as PEP 503 compares names."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)[1]
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(setup_cfg: Path) -> tuple[set[str], dict[str, set[str]]]:
    """(install_requires, {extra: its requirements}), as normalized distribution names."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)

    def names(text: str) -> set[str]:
        return {_distribution(line) for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")}

    extras = {extra: names(text) for extra, text in parser["options.extras_require"].items()}
    return names(parser["options"]["install_requires"]), extras


@dataclass(frozen=True)
class Import:
    module: str        # the top-level import name: PIL, yaml, torch
    where: str         # file:line
    in_function: bool


class _Imports(ast.NodeVisitor):
    def __init__(self, where: str):
        self.where, self.depth, self.found = where, 0, []

    def _add(self, name: str, node: ast.AST) -> None:
        self.found.append(Import(name.split(".")[0], f"{self.where}:{node.lineno}",
                                 self.depth > 0))

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:  # relative imports are the package's own
            self._add(node.module, node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else \
            getattr(function, "id", None)
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def third_party_imports(package: Path) -> list[Import]:
    found = []
    for path in sorted(package.rglob("*.py")):
        visitor = _Imports(str(path.relative_to(package.parent)))
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += [i for i in visitor.found if i.module not in sys.stdlib_module_names
                  and i.module != package.name]
    return found


def undeclared(package: Path, setup_cfg: Path) -> list[str]:
    """One line per import that a fresh install could not satisfy."""
    required, extras = declared(setup_cfg)
    optional = set().union(*(extras[name] for name in OPTIONAL_EXTRAS))
    providers = _providers()
    problems = []
    for found in third_party_imports(package):
        dists = {_distribution(d) for d in providers.get(found.module, ())}
        if not dists:
            problems.append(f"{found.where}: imports {found.module}, which no installed "
                            f"distribution provides")
        elif dists & required:
            continue
        elif dists & optional and found.in_function:
            continue
        elif dists & optional:
            problems.append(f"{found.where}: imports {found.module} (an optional extra's, "
                            f"{sorted(dists)}) at module level; import it inside the function "
                            f"that needs it")
        else:
            problems.append(f"{found.where}: imports {found.module} ({sorted(dists)}), which "
                            f"setup.cfg's install_requires does not declare")
    return problems


def test_every_third_party_import_of_the_product_is_declared():
    problems = undeclared(REPO / "accel_train", REPO / "setup.cfg")
    assert not problems, "\n".join(problems)


def test_the_walk_sees_the_product_imports():
    """The walk reads what it should: the product's known dependencies, at module level and
    inside functions, and a literal import_module."""
    found = third_party_imports(REPO / "accel_train")
    modules = {i.module for i in found}
    assert {"torch", "timm", "accelerate", "datasets", "yaml", "PIL", "numpy",
            "safetensors"} <= modules, modules
    assert any(i.module == "onnx" and i.in_function for i in found)
    assert not any(i.module == "onnx" and not i.in_function for i in found)


def test_a_planted_undeclared_import_fails(tmp_path):
    """The check against a copy of the package with an undeclared import (psutil: installed
    here by the test extra, not declared for the product) and an optional one at module level."""
    package = tmp_path / "accel_train"
    shutil.copytree(REPO / "accel_train", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert undeclared(package, REPO / "setup.cfg") == []
    errors = package / "base" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef memory():\n    import psutil\n"
                      "    return psutil.virtual_memory()\n")
    ranks = package / "base" / "ranks.py"
    ranks.write_text("import onnxruntime\n" + ranks.read_text())
    problems = undeclared(package, REPO / "setup.cfg")
    assert len(problems) == 2, problems
    assert problems[0].startswith("accel_train/base/errors.py:") and \
        "imports psutil (['psutil']), which setup.cfg's install_requires does not declare" \
        in problems[0], problems
    assert problems[1].startswith("accel_train/base/ranks.py:1: imports onnxruntime") and \
        "at module level" in problems[1], problems
