"""What a schedule is, besides its generator: name, description, constraints, layout, copies of parameters.

Each family module declares its schedules as ``ScheduleInfo`` values next to their generators
(``SCHEDULES``); ``builtin.BUILTIN`` lists them all and the registry serves them. Nothing here
imports a family, so the families and the registry import this module and never each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

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
    fb_units: bool = False  # its order pairs each rank's two stages in F&B units (DualPipe, DualPipeV)

    @property
    def options(self) -> list[str]:
        params = list(inspect.signature(self.build).parameters.values())[2:]
        return [p.name for p in params]

    def layout(self, num_ranks: int, num_microbatches: int = 2, **options: object) -> Placement:
        """The placement this schedule runs on for these parameters, without building the schedule.

        What the planner and model families need (stage counts, which stages a rank holds)
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
