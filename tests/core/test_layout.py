"""The architecture, checked: concept packages, one-way imports, no cycles, no private reach-ins."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = ig
_spec.loader.exec_module(ig)

# The order a package may import along: each only from those before it in its layer.
CORE_ORDER = ["stats", "specs", "plan", "cost", "control", "sim"]
RUNTIME_ORDER = ["engine", "data", "state", "train"]


@pytest.fixture(scope="module")
def graph():
    return ig.build()


def test_no_import_cycle_between_files(graph):
    assert ig.cycles(graph.edges) == []


def test_no_module_takes_another_modules_private_name(graph):
    assert graph.private == []


def test_the_checks_catch_what_they_claim(tmp_path):
    pkg = tmp_path / "copus"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from copus.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from copus import a\n    return a._hidden\n")
    (pkg / "c.py").write_text("from copus.b import _secret\n")
    g = ig.build(pkg)
    assert ig.cycles(g.edges) == [["copus.a", "copus.b"]]
    assert sorted(g.private) == [("copus.b", "copus.a", "_hidden"), ("copus.c", "copus.b", "_secret")]


def test_core_never_imports_torch(graph):
    bad = {m for m, ext in graph.external.items() if m.startswith("copus.core") and "torch" in ext}
    assert bad == set()


@pytest.mark.parametrize("layer,order", [("core", CORE_ORDER), ("runtime", RUNTIME_ORDER)])
def test_each_layer_shows_at_most_8_concepts_and_imports_one_way(graph, layer, order):
    folder = ROOT / "src" / "copus" / layer
    entries = sorted(p.name for p in folder.iterdir() if p.name not in {"__pycache__", "__init__.py"})
    assert entries == sorted(order) and len(entries) <= 8
    rank = {f"copus.{layer}.{name}": i for i, name in enumerate(order)}
    for a, b in ig.package_edges(graph, f"copus.{layer}"):
        assert rank[b] < rank[a], f"{a} imports {b}, which comes after it"


@pytest.mark.parametrize("layer,order", [("core", CORE_ORDER), ("runtime", RUNTIME_ORDER)])
def test_every_package_says_what_it_is_for_and_may_import(layer, order):
    for name in order:
        init = ROOT / "src" / "copus" / layer / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 2 and "May import" in doc, init


def test_runtime_packages_never_import_back_up_the_chain(graph):
    """config -> plan -> build -> loop: no core module imports copus.config or the runtime."""
    for m, deps in graph.edges.items():
        if m.startswith("copus.core"):
            assert not any(d.startswith(("copus.runtime", "copus.config", "copus.commands")) for d in deps), m


def test_api_reference_matches_the_docstrings():
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "tools" / "gen_api_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "docs" / "api.md").read_text().strip() == mod.render().strip(), (
        "docs/api.md is stale: python tools/gen_api_docs.py > docs/api.md"
    )
