"""The planner's models that a family describes itself: ``mt-dualpipe plan --model qwen3-moe``.

A name here gives the family preset's ``planner_spec`` (its ``spec.py``), whose saved bytes per token are
read from the modules' ``saved_per_token`` declarations, instead of a bundled JSON description
(``planner/models/*.json``, whose saved bytes follow ``planner/activations.py``). The family is imported only
when its name is asked for (it needs torch: the declarations are read from layers built on the meta
device), so planning DeepSeek-V3 or a JSON model loads no model code.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planner.model import ModelSpec

# name -> (family package, its config class, the preset, the plan's model name)
PLANNER_MODELS: dict[str, tuple[str, str, str, str]] = {
    "qwen3-moe": ("mt_dualpipe.models.qwen3_moe", "Qwen3MoeConfig", "30b-a3b", "qwen3_30b_a3b"),
    "qwen3-30b-a3b": ("mt_dualpipe.models.qwen3_moe", "Qwen3MoeConfig", "30b-a3b", "qwen3_30b_a3b"),
    "llama3-8b": ("mt_dualpipe.models.llama", "LlamaConfig", "8b", "llama3_8b"),
    "llama-3.1-8b": ("mt_dualpipe.models.llama", "LlamaConfig", "8b", "llama3_8b"),
}


def planner_model(name: str) -> ModelSpec | None:
    """The ``ModelSpec`` of a family preset named ``name`` (case-insensitive), or None when no family
    describes that name (the caller then reads a bundled or given JSON)."""
    entry = PLANNER_MODELS.get(name.lower())
    if entry is None:
        return None
    package, config_class, preset, model_name = entry
    config = getattr(importlib.import_module(package), config_class).preset(preset)
    spec = importlib.import_module(f"{package}.spec").planner_spec(config)
    return dataclasses.replace(spec, name=model_name, source=f"{package} preset {preset!r}, declared saved bytes")
