"""``build_schedule("auto", ...)``: check the options, run the search, describe the result in ``meta``."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..costs import Costs
from ..errors import ScheduleError
from ..info import ScheduleInfo
from ..ir import Schedule
from .cpsat import load_cp_model, solve
from .layout import Layout
from .search import Search, check_options, heuristic

SOLVERS = ("heuristic", "cpsat")


def _check_solver(solver: object, time_limit: object) -> None:
    if solver not in SOLVERS:
        raise ScheduleError(f"unknown solver {solver!r}; allowed: {', '.join(SOLVERS)}")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or time_limit <= 0):
        raise ScheduleError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")


def _check_microbatch_costs(costs: Costs, num_microbatches: int, solver: str) -> None:
    """Per-micro-batch factors must name every micro-batch of the step; the exact backend has no model of them."""
    if costs.mb_scale is None:
        return
    if len(costs.mb_scale) != num_microbatches:
        raise ScheduleError(f"costs.mb_scale has {len(costs.mb_scale)} factors but the step has {num_microbatches} "
                            "micro-batches; give one factor per micro-batch, in the order they arrive")
    if solver == "cpsat" and costs.uneven:
        raise ScheduleError("solver='cpsat' models micro-batches of equal cost; with uneven costs.mb_scale use "
                            "solver='heuristic'")


def _polish(search: Search, seed: int, time_limit: float, floor: float) -> dict:
    """Run CP-SAT from the heuristic's best; keep its order if the simulator confirms it is better."""
    best = search.best_ordered or search.best
    got = solve(search.layout, search.costs, search.limits, best.ranks, best.makespan, time_limit, seed, floor)
    if got.ranks is not None:
        search.consider(got.ranks, "cpsat")
    return {"solver_status": got.status, "solver_seconds": round(got.seconds, 3), "solver_bound": got.bound,
            "solver_proved": got.proved, **{f"solver_{k}": v for k, v in got.stats.items()}}


def build_auto(num_ranks: int, num_microbatches: int, costs: Costs | None = None,
               memory_limit: int | Sequence[int] | None = None, placement: str = "linear", seed: int = 0,
               time_budget: float | None = None, iterations: int | None = None, solver: str = "heuristic",
               time_limit: float | None = None, chains: int = 1, workers: int | None = None) -> Schedule:
    """Search an op order for ``costs`` that fits ``memory_limit`` activations per rank.

    ``iterations`` bounds the search: that many randomised list-scheduling walks, then ten times
    as many local-search moves, at least 1000, and ten times as many annealing steps (default: one
    walk per 8 ops of the problem, 10 to 200, and annealing as ``search.anneal_plan`` sizes it;
    0 keeps only the hand schedules and the policy grid).
    The search is bounded by ``iterations``, not by the clock, so the result is deterministic for a
    given seed (about 1 s of CPU at P <= 4, M <= 8; at most about 5 s on two cores at P=8, M=24, this
    process and one child; it ends as soon as an order reaches ``bound.lower_bound``, milliseconds on
    uniform costs). ``time_budget``
    (seconds, default None: no cap) additionally stops any phase once a first valid schedule
    exists — faster, but then the result depends on the machine's speed
    (``meta["stopped_by_time_budget"]`` says whether it did).

    On large problems (more than ``search.SMALL_PROBLEM_OPS`` ops, ``iterations`` not given)
    ``chains`` more annealing chains (default 1, 0: none) start from the best hand schedule at once,
    each with its own seed, in child processes beside the search as far as ``workers`` allows
    (default: one per chain plus this one, at most the machine's cores; 1: all here, after the
    search), and their orders compete with the search's. More chains find better orders (each
    lands in a good basin or not) at no more wall time while there are cores for them. The result
    depends on ``seed`` and ``chains``, never on ``workers`` (``search.hand_chain_jobs``).
    ``meta["hand_chains"]`` gives each chain's start, makespan (None when the best order reached
    the lower bound first and the chain was not waited for) and whether it ran in a child.

    Uneven micro-batches (``costs.mb_scale``, one factor per micro-batch in arrival order): ``auto`` also
    chooses which micro-batch each slot runs (``Schedule.microbatch_order``, ``meta["microbatch_order"]``)
    and is never worse than the hand schedules run in arrival order (``order``).

    ``solver="cpsat"`` then polishes the heuristic's best with the exact CP-SAT model for up to
    ``time_limit`` seconds (default 10; needs ``pip install mt_dualpipe[solver]``): ``meta`` gets
    its proven ``lower_bound``, ``optimal`` and ``gap``, which the heuristic alone also reports
    against the bound of ``bound.lower_bound``.
    """
    costs = Costs() if costs is None else costs
    check_options(costs, seed, time_budget, iterations, chains, workers)
    _check_solver(solver, time_limit)
    if solver == "cpsat":
        load_cp_model()  # fail before searching when OR-Tools is missing
    layout = Layout.named(placement, num_ranks, num_microbatches)
    _check_microbatch_costs(costs, num_microbatches, solver)
    started = time.perf_counter()
    search, info = heuristic(layout, costs, memory_limit, seed, time_budget, iterations, chains, workers)
    bound = search.floor
    extra: dict = {}
    if solver == "cpsat":
        extra = _polish(search, seed, 10.0 if time_limit is None else float(time_limit), bound)
        bound = max(bound, extra["solver_bound"])
    best = search.best
    sched = search.make(best.ranks)
    sched.microbatch_order = search.order
    optimal = best.makespan <= bound + 1e-9
    sched.meta = {
        "placement": placement, "seed": seed, "memory_limit": info["memory_limit"], "costs": costs.describe(),
        "makespan": best.makespan, "peak_activations": best.peak, "source": best.source,
        "baselines": info["baselines"], "lower_bound": min(bound, best.makespan), "optimal": optimal,
        "gap": 0.0 if optimal or not best.makespan else (best.makespan - bound) / best.makespan,
        "solver": solver, "walks": info["walks"], "hand_chains": info["hand_chains"],
        "search_seconds": info["search_seconds"],
        **({"microbatch_order": info["microbatch_order"]} if "microbatch_order" in info else {}),
        "seconds": round(time.perf_counter() - started, 3), "stopped_by_time_budget": info["stopped_by_time_budget"],
        **extra,
    }
    return sched


SCHEDULES = (
    ScheduleInfo("auto", "cost-aware search (list scheduling + local search, optional CP-SAT) under a per-rank "
                 "activation limit",
                 "any P >= 1, M >= 1 (dual: M >= 2); costs, memory_limit, placement linear|v|dual, "
                 "solver heuristic|cpsat, chains, workers",
                 placement="option",
                 build=build_auto),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
