"""mt_dualpipe: DualPipe and Zero-Bubble pipeline parallelism for PyTorch.

The schedule compiler (``mt_dualpipe.schedules``) is pure Python; the runtime classes below need
torch and are imported lazily, so ``import mt_dualpipe.schedules`` never loads torch. Subpackages
resolve on first use too: ``import mt_dualpipe as md; md.schedules.build_schedule(...)``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DualPipe": "mt_dualpipe.runtime.modules",
    "DualPipeV": "mt_dualpipe.runtime.modules",
    "Pipeline": "mt_dualpipe.runtime.modules",
    "WeightGradStore": "mt_dualpipe.runtime.weight_grad",
    "split_model": "mt_dualpipe.runtime.split",
    "profile": "mt_dualpipe.planner.profile",
    "from_pretrained": "mt_dualpipe.models.registry",
    "stages_for_rank": "mt_dualpipe.models.stage_entry",
    "criterion_for": "mt_dualpipe.models.stage_entry",
}


SUBPACKAGES = ("cli", "data", "fp8", "layers", "models", "optim", "parallel", "planner", "resilience", "runtime",
               "schedules", "visualize")
"""Resolved on first use like the names above: ``mt_dualpipe.schedules`` loads no torch, ``runtime`` does."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mt_dualpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(SUBPACKAGES))
