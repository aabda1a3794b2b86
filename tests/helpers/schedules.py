"""Shared pieces of the schedule-compiler tests: unit costs and every hand schedule that builds."""

from __future__ import annotations

from mt_dualpipe.schedules import Costs, Schedule, ScheduleError, build_schedule, list_schedules


def unit() -> Costs:
    """F = B = W = 1: the costs the worked values of docs/schedules.md use."""
    return Costs(1, 1, 1)


def all_buildable(P: int, M: int) -> list[Schedule]:
    """Every registered hand schedule (not ``auto``) that accepts (P, M)."""
    out = []
    for info in list_schedules():
        if info.name == "auto":
            continue
        try:
            out.append(build_schedule(info.name, P, M))
        except ScheduleError:
            pass
    return out
