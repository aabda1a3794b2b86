"""Parallel-strategy planning: model / system descriptions, step-time and memory estimates, search.

``plan(model, system, gpus)`` enumerates pipeline size, schedule, micro-batches, expert and data
parallelism, estimates each with a compute/communication model and this library's simulator,
and ranks those that fit. ``mt_dualpipe.profile`` (in ``planner.profile``, needs torch) measures
the per-stage costs of a real pipeline so that the ``auto`` schedule plans for the real machine.
Nothing here imports torch except ``profile``.
"""

from .estimate import Estimate, Strategy, estimate
from .model import ModelSpec
from .search import PlanResult, plan
from .system import PRESETS, SystemSpec, load_system

__all__ = ["Estimate", "Strategy", "estimate", "ModelSpec", "PlanResult", "plan", "PRESETS", "SystemSpec",
           "load_system"]
