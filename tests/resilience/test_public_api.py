"""Resilience reaches the runtime through public, existing API only: a rename in the runtime fails here.

``mypy`` (``.ci/run``) checks the typed uses, but ``nn.Module.__getattr__`` lets any attribute of a
module type-check, so this test reads resilience's source with ``ast``: every attribute it takes
of a pipeline (``pipeline.x``, ``self.pipeline.x``, ``old.x``, ``new.x``) must be public and must be
defined by ``Pipeline`` / ``DualPipe`` (a class attribute, property or method, or an instance
attribute its ``__init__`` family assigns), or by ``LocalPipeline``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from mt_dualpipe.resilience.local import LocalPipeline
from mt_dualpipe.runtime.modules import DualPipe, Pipeline

RESILIENCE = Path(__file__).resolve().parents[2] / "mt_dualpipe" / "resilience"
TAKES_A_PIPELINE = ("rewind.py", "regroup.py", "names.py")  # the modules handed a pipeline
PIPELINE_NAMES = {"pipeline", "old", "new"}


def _pipeline_attributes() -> dict[str, list[str]]:
    """Attribute name -> where resilience takes it of a pipeline."""
    found: dict[str, list[str]] = {}
    for path in (RESILIENCE / name for name in TAKES_A_PIPELINE):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            name = base.id if isinstance(base, ast.Name) else (
                base.attr if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                and base.value.id == "self" else None)
            if name in PIPELINE_NAMES:
                found.setdefault(node.attr, []).append(f"{path.name}:{node.lineno}")
    return found


def _instance_attributes(source: str) -> set[str]:
    """``self.<name> = ...`` anywhere in a class's source (its methods set the instance attributes)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.add(sub.attr)
    return out


def _problems(used: dict[str, list[str]], pipeline_source: str, pipeline_names: set[str]) -> dict[str, list[str]]:
    """What resilience takes of a pipeline that is private or that no pipeline class defines
    (``pipeline_names``: the class attributes of ``DualPipe``, which has every one of ``Pipeline``'s)."""
    defined = (pipeline_names | _instance_attributes(pipeline_source)
               | set(dir(LocalPipeline)) | _instance_attributes(inspect.getsource(LocalPipeline)))
    return {a: w for a, w in used.items() if a.startswith("_") or a not in defined}


def test_resilience_takes_only_public_existing_attributes_of_a_pipeline():
    used = _pipeline_attributes()
    assert {"mesh_ranks", "reduced_gradient_shards", "sync_groups", "replace_sync_group", "rebuilt",
            "grad_syncs"} <= set(used)  # the scan sees what rewind and regroup use
    assert _problems(used, inspect.getsource(Pipeline), set(dir(DualPipe))) == {}  # DualPipe: Pipeline's and more


def test_a_renamed_runtime_attribute_fails_the_check():
    used = _pipeline_attributes()
    renamed = inspect.getsource(Pipeline).replace("self.grad_syncs:", "self._grad_syncs:")
    names = set(dir(DualPipe)) - {"mesh_ranks"}  # as if the property had been renamed too
    assert set(_problems(used, renamed, names)) == {"grad_syncs", "mesh_ranks"}
