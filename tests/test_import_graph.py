"""The package's import graph: no cycle, and every arrow points down the layer order of docs/architecture.md.

The graph is built with ``ast`` from every ``import`` in ``mt_dualpipe`` — at module level and inside
functions alike (an import inside a function still runs, and hiding a circle there only moves it);
imports under ``if TYPE_CHECKING:`` do not run and are left out. ``from . import x`` is an edge to the
submodule ``x`` when there is one, else to the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mt_dualpipe"
DOC = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (module level or in a function), not those under TYPE_CHECKING."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for sub in node.orelse:
                visit(sub)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                targets.add(sub if sub in mods else origin)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def documented_layers() -> list[str]:
    """The layer order, lowest first, from the line ``Layer order (lowest first): `a` → `b` → ...``."""
    match = re.search(r"^Layer order \(lowest first\): (.+)$", DOC.read_text(), re.MULTILINE)
    assert match, f"{DOC} must state the layer order in one line 'Layer order (lowest first): `a` → `b` ...'"
    return re.findall(r"`([a-z_0-9]+)`", match.group(1))


def _under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_every_import_points_down_the_documented_layers():
    layers = documented_layers()
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert sorted(layers) == packages, "the documented layer order must name every subpackage once"
    rank = {name: i for i, name in enumerate(layers)}
    upward = []
    for src, targets in import_graph().items():
        a = _layer_of(src)
        for dst in targets:
            b = _layer_of(dst)
            if a is not None and b is not None and rank[b] > rank[a]:
                upward.append(f"{src} -> {dst}")
    assert upward == []


def test_the_checker_finds_a_planted_cycle_and_an_upward_arrow():
    graph = {"mt_dualpipe.a.x": {"mt_dualpipe.a.y"}, "mt_dualpipe.a.y": {"mt_dualpipe.a.z"},
             "mt_dualpipe.a.z": {"mt_dualpipe.a.x"}, "mt_dualpipe.b.w": set()}
    assert cycles(graph) == [["mt_dualpipe.a.x", "mt_dualpipe.a.y", "mt_dualpipe.a.z"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    assert sorted(n.names[0].name for n in _imports(tree) if isinstance(n, ast.Import)) == ["b", "c"]


def test_no_model_family_imports_another():
    """Families (the registry's modules, the transformers adapter included) share code only through
    ``mt_dualpipe.layers`` and what stages are built with (``models/decoder_stage.py`` and its neighbours)."""
    from mt_dualpipe.models.registry import ADAPTER, FAMILIES

    families = sorted({f.module for f in (*FAMILIES.values(), ADAPTER)})
    crossing = []
    for src, targets in import_graph().items():
        home = next((f for f in families if _under(src, f)), None)
        for dst in targets:
            other = next((f for f in families if _under(dst, f)), None)
            if home and other and other != home:
                crossing.append(f"{src} -> {dst}")
    assert crossing == []
