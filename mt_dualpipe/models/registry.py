"""One entry point for every family: ``from_pretrained(path)`` reads ``config.json``'s ``model_type``.

A family is registered by ``model_type`` -> (module, class name) and imported only when asked for,
so loading a Qwen3-MoE checkpoint never imports DeepSeek-V3 and vice versa. The class must offer
``from_pretrained(path, **kwargs)`` (and ``save_pretrained`` back to the same layout).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("mt_dualpipe.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "llama": ("mt_dualpipe.models.llama", "LlamaForCausalLM"),
    "deepseek_v3": ("mt_dualpipe.models.deepseek_v3", "DeepSeekV3Model"),
    "llava": ("mt_dualpipe.models.llava", "LlavaForConditionalGeneration"),
}


def register_family(model_type: str, module: str, class_name: str) -> None:
    """Make ``from_pretrained`` load ``model_type`` checkpoints with ``module.class_name``."""
    FAMILIES[model_type] = (module, class_name)


def model_type_of(path: str | os.PathLike) -> str:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face checkpoint folder)")
    model_type = json.loads(cfg.read_text()).get("model_type")
    if not model_type:
        raise ValueError(f"{cfg} has no model_type")
    return str(model_type)


def family(model_type: str) -> type:
    """The model class registered for ``model_type`` (imported now)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; registered: {sorted(FAMILIES)}")
    module, name = FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Any:
    """The family's model loaded from a Hugging Face folder; ``kwargs`` (``dtype``, ``device``, config
    overrides, ...) go to the family's own ``from_pretrained``."""
    return family(model_type_of(path)).from_pretrained(path, **kwargs)
