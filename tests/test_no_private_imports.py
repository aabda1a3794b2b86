"""No module imports another module's private (underscore) name — tests, examples and benchmarks included.

A private name is an implementation detail of its module; reaching for it from elsewhere couples the
two so that neither can change alone. Shared test code lives in ``tests/helpers``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("mt_dualpipe", "tests", "examples", "benchmarks")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("mt_dualpipe", "tests")


def private_imports(path: Path) -> list[str]:
    """``from m import _x`` and ``m._x`` where ``m`` is a name this file imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    imported = set()  # names bound to this project's modules and objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.level or _ours(node.module or "")):
            imported |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported \
                and _private(node.attr):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                name = alias.name
                if _private(name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {name}")
    return found


def test_no_module_imports_a_private_name() -> None:
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            found += private_imports(path)
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    bad = ROOT / "tests" / "_probe_private_import.py"
    try:
        bad.write_text("from mt_dualpipe.schedules.validate import _misplaced\n", encoding="utf-8")
        assert private_imports(bad) == ["tests/_probe_private_import.py:1 from mt_dualpipe.schedules.validate "
                                        "import _misplaced"]
    finally:
        bad.unlink()
