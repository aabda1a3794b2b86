"""mt_dualpipe: DualPipe and Zero-Bubble pipeline parallelism for PyTorch.

The schedule compiler (``mt_dualpipe.schedules``) is pure Python; the runtime classes below need
torch and are imported lazily, so ``import mt_dualpipe.schedules`` never loads torch.
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
    "profile": "mt_dualpipe.planner.profile",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mt_dualpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
