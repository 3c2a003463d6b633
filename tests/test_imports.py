"""Every `from copus... import name` in the package resolves, the lazy ones inside functions too.

Commands import their torch side inside `run` (so `copus --help` stays fast); a module move that
leaves such an import stale only fails when a user runs that command. This test reads every module
under src/copus with `ast`, and imports each copus module and name it names.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `path`)."""
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _files() -> list[Path]:
    return sorted([*(SRC / "copus").rglob("*.py"), *(ROOT / "examples").glob("*.py"), *(ROOT / "bench").glob("*.py")])


@functools.cache
def copus_imports() -> tuple[tuple[str, int, str, str | None], ...]:
    """(file, line, module, name or None) for every copus import in src/copus, examples/ and
    bench/, lazy or not."""
    found = []
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            where = str(path.relative_to(ROOT))
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, path)
                if module.split(".")[0] == "copus":
                    found += [(where, node.lineno, module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(where, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "copus"]
    return tuple(found)


def test_the_walk_finds_the_lazy_imports_of_the_commands():
    lazy = {(m, n) for f, _, m, n in copus_imports() if f == "src/copus/commands/calibrate.py"}
    assert ("copus.runtime.train", "launch") in lazy  # inside run()
    assert ("copus.runtime.train.launch", "calibrate_worker") in lazy
    assert len(copus_imports()) > 300


def test_every_copus_import_resolves():
    stale = []
    for where, line, module, name in copus_imports():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            stale.append(f"{where}:{line}: import {module}: {exc}")
            continue
        if name is None or name == "*" or hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            stale.append(f"{where}:{line}: from {module} import {name}: no such name")
    assert not stale, "\n".join(stale)


@pytest.mark.parametrize(
    "command", ["train", "plan", "profile", "simulate", "report", "prepare", "export", "calibrate"]
)
def test_every_subcommand_module_has_add_arguments_and_run(command):
    from copus.cli import SUBCOMMANDS

    assert command in SUBCOMMANDS
    module = importlib.import_module(f"copus.commands.{command}")
    assert callable(module.add_arguments) and callable(module.run)
