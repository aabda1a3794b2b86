"""Name -> generator table behind ``build_schedule`` and ``list_schedules``.

The table starts as the built-ins (``builtin.BUILTIN``: every family module's ``SCHEDULES``, one
list) and grows only by ``register`` (a user's own generator). The registry checks the common
parameters (positive integers, unknown options) once, so generators only check their own rules.
The families never import the registry: the arrow points one way.
"""

from __future__ import annotations

from collections.abc import Callable

from ._perf import gc_paused
from .builtin import BUILTIN
from .errors import ScheduleError
from .info import ScheduleInfo
from .ir import Schedule

__all__ = ["ScheduleInfo", "accepts", "build_schedule", "has_fb_units", "list_schedules", "register",
           "schedule_info"]


_REGISTRY: dict[str, ScheduleInfo] = {info.name: info for info in BUILTIN}
"""Process-wide by nature: ``build_schedule`` is a function, so the table it reads is the module's."""


def register(name: str, description: str, constraints: str, *, param_copies: int = 1,
             placement: str = "linear", fb_units: bool = False
             ) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    """Decorator adding a user's generator ``(num_ranks, num_microbatches, **options) -> Schedule``."""
    def deco(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
        _REGISTRY[name] = ScheduleInfo(name, description, constraints, fn, param_copies, placement, fb_units)
        return fn
    return deco


def schedule_info(name: str) -> ScheduleInfo:
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def has_fb_units(name: str) -> bool:
    """Whether the schedule called ``name`` pairs each rank's two stages in F&B units (``ScheduleInfo.fb_units``;
    False for a name not registered): the stage cut then gives a block to any stage whose partner holds MoE
    blocks (``planner.stage_cut``)."""
    return name in _REGISTRY and _REGISTRY[name].fb_units


def list_schedules() -> list[ScheduleInfo]:
    """Every registered schedule with a one-line description and its constraints."""
    return list(_REGISTRY.values())


def _check_count(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ScheduleError(f"{what} must be at least {minimum}, got {value}")
    return value


@gc_paused
def build_schedule(name: str, num_ranks: int, num_microbatches: int, **options: object) -> Schedule:
    """Build the named schedule for ``num_ranks`` ranks and ``num_microbatches`` micro-batches.

    Raises ``ScheduleError`` naming what is wrong and what is allowed for bad parameters.
    """
    info = schedule_info(name)
    _check_count("num_ranks", num_ranks, 1)
    _check_count("num_microbatches", num_microbatches, 1)
    allowed = info.options
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        hint = f"allowed: {', '.join(allowed)}" if allowed else "it takes no options"
        raise ScheduleError(f"schedule {name!r} got unknown option(s) {', '.join(unknown)}; {hint}")
    return info.build(num_ranks, num_microbatches, **options)


def accepts(name: str, num_ranks: int, num_microbatches: int, **options: object) -> str | None:
    """None if ``name`` can be built for these parameters, else the reason it cannot.

    A searching schedule (one with an ``iterations`` option: ``auto``) is built with
    ``iterations=0`` unless given: whether it *can* be built does not depend on how long it searches,
    and the full search (seconds) would make this check cost as much as the build.
    """
    if "iterations" in schedule_info(name).options:
        options = {"iterations": 0, **options}
    try:
        build_schedule(name, num_ranks, num_microbatches, **options)
    except ScheduleError as exc:
        return str(exc)
    return None
