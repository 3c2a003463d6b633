"""The import graph of `src/copus`, read from the source (no imports executed).

`python tools/import_graph.py` prints the file-level cycles, the imports of private names across
modules and the package-level edges; tests/core/test_layout.py asserts on the same functions.
Every import counts, including the ones inside functions and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "copus"


@dataclass
class Graph:
    """`edges[m]`: the copus modules `m` imports; `private[(m, target)]`: the `_names` it takes."""

    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)
    private: list[tuple[str, str, str]] = field(default_factory=list)
    external: dict[str, set[str]] = field(default_factory=dict)


def _module_names(root: Path) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def build(root: Path = SRC) -> Graph:
    """Parse every module under `root` and collect its copus imports."""
    g = Graph(_module_names(root))
    for name, path in g.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        ext: set[str] = set()
        aliases: dict[str, str] = {}  # local name -> copus module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                ext.add(mod.split(".")[0])
                for a in node.names:
                    full = f"{mod}.{a.name}"
                    if full in g.modules:
                        deps.add(full)
                        aliases[a.asname or a.name] = full
                    elif mod in g.modules:
                        deps.add(mod)
                        if _is_private(a.name) and mod != name:
                            g.private.append((name, mod, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    ext.add(a.name.split(".")[0])
                    if a.name in g.modules:
                        deps.add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
        for node in ast.walk(tree):  # module._private through an imported copus module
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _is_private(node.attr)
                and aliases[node.value.id] != name
            ):
                g.private.append((name, aliases[node.value.id], node.attr))
        g.edges[name] = deps - {name}
        g.external[name] = ext
    return g


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package_of(module: str, depth: int = 3) -> str:
    """`copus.core.plan.search` -> `copus.core.plan` (the first `depth` dotted parts)."""
    return ".".join(module.split(".")[:depth])


def package_edges(g: Graph, prefix: str) -> set[tuple[str, str]]:
    """(package, package) pairs among the subpackages of `prefix` (e.g. "copus.core")."""
    depth = prefix.count(".") + 2
    out = set()
    for m, deps in g.edges.items():
        if not m.startswith(prefix + "."):
            continue
        for d in deps:
            a, b = package_of(m, depth), package_of(d, depth)
            if d.startswith(prefix + ".") and a != b and a != prefix and b != prefix:
                out.add((a, b))
    return out


if __name__ == "__main__":
    graph = build()
    print("cycles:", cycles(graph.edges) or "none")
    print("private imports:", graph.private or "none")
    for layer in ("copus.core", "copus.runtime"):
        for a, b in sorted(package_edges(graph, layer)):
            print(f"{a} -> {b}")
