"""Name -> generator table behind ``build_schedule`` and ``list_schedules``.

Each family module registers its generators with ``@register``; the registry checks the common
parameters (positive integers, unknown options) once, so generators only check their own rules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ._perf import gc_paused
from .errors import ScheduleError
from .ir import Schedule
from .placements import Placement, make_placement


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    description: str
    constraints: str
    build: Callable[..., Schedule]
    param_copies: int = 1  # 2 for dualpipe: every stage's parameters live on two ranks
    placement: str = "linear"  # a name of placements.PLACEMENTS, or "option" (auto: its placement= option)

    @property
    def options(self) -> list[str]:
        params = list(inspect.signature(self.build).parameters.values())[2:]
        return [p.name for p in params]

    def layout(self, num_ranks: int, num_microbatches: int = 2, **options: object) -> Placement:
        """The placement this schedule runs on for these parameters, without building the schedule.

        What the planner and model integrations need (stage counts, which stages a rank holds)
        without generating an order.
        """
        name = self.placement
        defaults = {p.name: p.default for p in inspect.signature(self.build).parameters.values()
                    if p.default is not inspect.Parameter.empty}
        if name == "option":
            name = str(options.get("placement", defaults.get("placement", "linear")))
        v = options.get("virtual_stages", defaults.get("virtual_stages", 2))
        return make_placement(name, num_ranks, max(num_microbatches, 2), virtual_stages=int(v))

    def num_stages(self, num_ranks: int, **options: object) -> int:
        """Stages per chain for ``num_ranks`` ranks (P linear and dual, 2P v, vP interleaved)."""
        return self.layout(num_ranks, **options).num_stages


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(name: str, description: str, constraints: str, *, param_copies: int = 1,
             placement: str = "linear") -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    def deco(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
        _REGISTRY[name] = ScheduleInfo(name, description, constraints, fn, param_copies, placement)
        return fn
    return deco


def _load_families() -> None:
    # importing the family modules fills the registry
    from . import auto, dualpipe, gpipe, interleaved, one_f_one_b, zero_bubble  # noqa: F401


def schedule_info(name: str) -> ScheduleInfo:
    _load_families()
    if name not in _REGISTRY:
        raise ScheduleError(f"unknown schedule {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def list_schedules() -> list[ScheduleInfo]:
    """Every registered schedule with a one-line description and its constraints."""
    _load_families()
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
