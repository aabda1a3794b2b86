"""What the docs and docstrings cite exists: file paths, ``mt_dualpipe.*`` dotted names, and
``module.name`` references into the package.

A reference is a backticked (Markdown) or double-backticked (reST docstring) string. Three kinds
are checked: a path ending in ``.py`` / ``.md`` / ``.sh`` (resolved against the repository root,
the package and the file's own folder), a dotted name starting with ``mt_dualpipe.``, and a dotted
name whose first part is a subpackage of ``mt_dualpipe`` (``parallel.stage_sync.DP_MODES``,
``runtime.modules.Pipeline``). Each dotted name must import, attribute by attribute.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mt_dualpipe"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
MD_REF = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
RST_REF = re.compile(r"``([^`\n]+)``")
PATH = re.compile(r"^[\w./-]+\.(py|md|sh)$")
DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if name in getattr(obj, "__dataclass_fields__", {}):  # a field without a class default
                return name == parts[-1]
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _problems(ref: str, where: Path) -> str | None:
    ref = ref.strip().rstrip("()").split("(")[0]
    if PATH.match(ref):
        bases = (ROOT, PACKAGE, where.parent)
        if "/" not in ref:  # a bare file name: a file of that name anywhere in the project
            return None if ref in _project_files() else f"{ref}: no such file"
        return None if any((b / ref).exists() for b in bases) else f"{ref}: no such file"
    if not DOTTED.match(ref):
        return None
    head = ref.split(".")[0]
    if head == "mt_dualpipe":
        return None if _resolves(ref) else f"{ref}: does not resolve"
    if head in SUBPACKAGES and ref.count(".") >= 1:
        return None if _resolves(f"mt_dualpipe.{ref}") else f"{ref}: does not resolve (as mt_dualpipe.{ref})"
    return None


@cache
def _project_files() -> set[str]:
    folders = ("mt_dualpipe", "docs", "benchmarks", "examples", "scripts", "tests", "requirements", ".ci")
    return {f.name for d in folders for f in (ROOT / d).rglob("*") if f.is_file()} | {f.name for f in ROOT.iterdir()}


def _docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)))]
    return [d for n in nodes if (d := ast.get_docstring(n))]


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.md"))]


@pytest.mark.parametrize("doc", _markdown(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_references_exist(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)  # code blocks show code, not references
    bad = sorted({p for ref in MD_REF.findall(text) if (p := _problems(ref, doc))})
    assert bad == []


def test_docstring_references_exist() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for doc in _docstrings(path):
            bad += [f"{path.relative_to(ROOT)}: {p}" for ref in RST_REF.findall(doc) if (p := _problems(ref, path))]
    assert sorted(set(bad)) == []


def test_the_checker_catches_a_wrong_name() -> None:
    assert _problems("parallel.stage_sync.DP_MODES", PACKAGE / "x.py") is None
    assert _problems("parallel.stage_sync.NO_SUCH", PACKAGE / "x.py") == (
        "parallel.stage_sync.NO_SUCH: does not resolve (as mt_dualpipe.parallel.stage_sync.NO_SUCH)")
    assert _problems("runtime/no_such.py", PACKAGE / "x.py") == "runtime/no_such.py: no such file"
