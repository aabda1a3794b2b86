"""The planner's models that a family describes itself: ``mt-dualpipe plan --model qwen3-moe`` (a preset's
name, ``registry.FAMILIES``' planner names) or ``--model path/config.json`` (the family's own Hugging Face
config as shipped, read through the family's config class).

Every family gives the planner its ``planner_spec(config)`` (its ``spec.py``), whose saved bytes per token are
read from the modules' ``saved_per_token`` declarations (with the config's ``memory_savers`` on). The family
is imported only when asked for (its declarations are read from layers built on the meta device), so planning a
JSON model loads no model code. The spec carries its family's ``Family.planned`` (``ModelSpec.facts``), so the
plan speaks of that family's modules and prints a miniature of its own tiny preset (``planner/families.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .registry import FAMILIES, Family, family_entry, read_config

if TYPE_CHECKING:
    from ..planner.model import ModelSpec


def planner_names() -> list[str]:
    """Every preset name ``plan --model`` takes."""
    return [p.name for f in FAMILIES.values() for p in f.planner_names]


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    spec: ModelSpec
    note: str = ""  # for a config.json: which keys shaped the model and which the plan ignored


def _spec(entry: Family, config: Any) -> ModelSpec:
    try:
        spec_module = importlib.import_module(f"{entry.module}.spec")
    except ModuleNotFoundError:
        spec_module = None
    if spec_module is not None and hasattr(spec_module, "planner_spec"):
        return spec_module.planner_spec(config)
    raise ValueError(f"the {entry.config_class} family has no planner description (a spec.py with planner_spec)")


def _config_path(name: str) -> Path | None:
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    return None


def planner_model(name: str, memory_savers: str | frozenset[str] = frozenset()) -> PlannedModel | None:
    """The planner's model for a family preset named ``name`` (case-insensitive) or a family's Hugging Face
    ``config.json`` (the file or its folder), with ``memory_savers`` on; None when neither (the caller then
    reads a bundled or SimuMax JSON)."""
    for entry in FAMILIES.values():
        for known in entry.planner_names:
            if known.name == name.lower():
                config = entry.load(entry.config_class).preset(known.preset, memory_savers=memory_savers)
                spec = _spec(entry, config)
                return PlannedModel(dataclasses.replace(
                    spec, name=known.plan_name, facts=entry.planned,
                    source=f"{entry.module} preset {known.preset!r}, declared saved bytes"))
    path = _config_path(name)
    if path is None:
        return None
    data = read_config(path)
    if "model_type" not in data:
        return None  # a SimuMax description
    entry = family_entry(str(data["model_type"]))
    config = entry.load(entry.config_class).from_hf(data, memory_savers=memory_savers)
    spec = _spec(entry, config)
    read = [k for k in data if k in entry.cost_keys]
    ignored = [k for k in data if k not in entry.cost_keys]
    note = (f"{path}: model_type {data['model_type']!r}, read by {entry.config_class}; the plan's model is built from "
            f"{', '.join(read)}; ignored (no effect on the plan's cost): {', '.join(ignored) or 'none'}")
    name_of = str(data.get("_name_or_path") or (path.parent.name if path.name == "config.json" else path.stem))
    return PlannedModel(dataclasses.replace(spec, name=name_of, source=f"{path.name} via {entry.config_class}",
                                            facts=entry.planned), note)
