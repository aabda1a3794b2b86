"""Shared pieces of the schedule-compiler tests: unit costs, every hand schedule that builds, random
annealing moves."""

from __future__ import annotations

import random

from mt_dualpipe.schedules import Costs, Schedule, ScheduleError, build_schedule, list_schedules
from mt_dualpipe.schedules.auto.local import ANNEAL_MOVES, neighbour


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


def random_move(ranks: list[list], rng: random.Random) -> tuple[int, list[list]]:
    """One random annealing move that applies (window 6): the rank it changed and the new orders."""
    while True:
        r = rng.randrange(len(ranks))
        cand = neighbour(ranks, rng, r, 6, ANNEAL_MOVES)
        if cand is not None:
            return r, cand
