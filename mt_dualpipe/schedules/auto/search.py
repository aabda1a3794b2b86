"""The search driver behind ``build_schedule("auto", ...)``.

0. **Micro-batch order** (uneven ``Costs.mb_scale`` only, ``order``): which micro-batch each slot
   runs; everything after works with the costs per slot.
1. **Candidates**: the hand schedules of the placement (``HAND_SCHEDULES``) that fit the memory
   limit, kept as they are, so ``auto`` is never worse than the best of them. On a large problem
   (one long chain, ``anneal_plan``) the best of them polished (``polish_hand``: backwards split,
   W's late) is where its chains start.
2. **List scheduling** (``listsched``): the policy grid, then the best six with the hold and cap
   variants (the variants not on large problems).
3. **Randomised walks**: the best policies with random tie-breaking, seeded (not on large problems).
4. **Local search** (``local``) on the best order.
5. **FB polish**, only where an FB unit can be cheaper than its halves (a rank with two stages and
   exposed all-to-all or a cheaper ``fb``): walks with eager W's, every BW split into B then W
   (never worse: same rank time and memory, gradients out one W sooner), W's pushed late, and a
   local search with ``FB_MOVES``. This is what the exact solver's schedules do differently.
6. **Warm-up caps** (on two-chain placements, or where FB units save time, not on large problems):
   coordinate descent on each stage's ``Policy.stage_caps``.
7. **Annealing** (``local.anneal``) from the few best orders of different makespans and the best
   capped one: crosses the moves that each cost something alone (unpair a unit here, move a B on
   the next rank) that the exact schedules are often separated from ours by. Its orders keep
   backwards split and micro-batches in order (``local.renumber``), so its result is also a hint
   the exact backend's symmetry breaking accepts. Medium problems run all but the first chain in
   a child process; the one long chain of a large problem starts from the polished hand schedule
   (unless the phases found an order ``HAND_START_MARGIN`` shorter) and is repaired on the way
   (``repair.anneal_repaired``).
8. **Hand chains** (large problems): one more annealing chain (``chains`` of them), from the same
   polished hand schedule with a seed of its own, repaired on the way and at its end in a child
   process (``chains``) started before phase 2, and weighed against the result at the end.
9. **Gap closing** (``local.close_gaps``): the best order of the phases and each hand chain's result
   get later W's run in the idle gaps they fit and held-back producers raised above the W's that
   delayed them; never worse, a few hundredths of a second. Annealing reaches neither move when the
   W or the chain of waits is far from the gap (P=8, M=24, 16 seeds, mean makespan: V with all-to-all
   1.0 of F 192.00 -> 191.13, five at the bound 190; 0.5 of F 173.91 -> 173.53; dual 0.5 of F
   85.94 -> 85.91, benchmarks/results/auto_schedule.md).
10. **Repairs** (``repair``), on the same orders: the cool-down list-scheduled again from 0.75, 0.8
   and 0.85 of the makespan on (``relist_cooldown``: ``listsched`` with each rank's earlier items as
   a prefix; annealing leaves W's ahead of ready B's there, which a greedy walk does not), and,
   where FB units pay, a stray lone F and B of the critical rank paired and the cool-down re-listed
   around the unit (``pair_strays``). Same profiles: V 1.0 of F 191.13 -> 190.00 (the optimum on
   every seed), 0.5 of F 173.53 -> 172.56 (best known now 172), dual 0.5 of F 85.91 -> 85.69.

Every candidate is scored by ``simulate.run_schedule`` (makespan, then peak activations), the
steps of local search and annealing by ``simulate.Replay``; the search is bounded by iteration
counts and re-simulated ops, not the clock, so a seed gives one result, wherever the hand chain ran.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .. import dualpipe, gpipe, one_f_one_b, zero_bubble
from ..costs import Costs, StageCosts
from ..errors import ScheduleError
from ..ir import ComputeItem, Schedule
from ..ops import OpTable
from ..simulate import run_schedule
from .bound import lower_bound
from .chains import ChainJob, Chains, default_workers
from .layout import Layout, memory_limits
from .listsched import list_schedule
from .local import (
    ANNEAL_COLD_REACH,
    ANNEAL_HEAT,
    ANNEAL_MOVES,
    ANNEAL_PLAIN_MOVES,
    FB_MOVES,
    Move,
    fits,
    in_microbatch_order,
    local_search,
    sink_ws,
    split_backward,
)
from .order import choose_order, improve_order, slot_costs
from .policies import Policy, fb_policies, policies
from .repair import anneal_repaired, repairs

HAND_SCHEDULES = {"linear": ("1f1b", "zb-h1", "zb-h2", "gpipe"), "v": ("zbv", "dualpipev"), "dual": ("dualpipe",)}
_HAND_BUILDERS = {info.name: info.build for family in (one_f_one_b, zero_bubble, gpipe, dualpipe)
                  for info in family.SCHEDULES}  # the families themselves: the registry sits above auto
"""The hand schedules ``auto`` starts from and must never lose to, per placement."""

Ranks = list[list[ComputeItem]]
SMALL_PROBLEM_OPS = 600
"""When ``iterations`` is not given, orders of up to this many ops (``op_count``) anneal as
``ANNEAL_CHAINS`` chains of ``ANNEAL_CHAIN_STEPS``; larger ones as one chain bounded by ``ANNEAL_WORK``."""
ANNEAL_WORK = 1_400_000
"""Work of one annealing chain on a large problem: the ops its replays walk (``simulate.Replay.walked``)
plus ``local.REPLAY_WORK`` per replay, which is about what each costs in time, so a budget gives each
placement about the same CPU and the cheaper one more steps. 1.4 M (with ``ANNEAL_HAND_WORK`` 2.0 M
beside it) is what fits ``auto`` at P=8, M=24 in about 5 s on two cores; it was 3.2 M (4.0 M) when a
chain started from the phases' best and ran without repairs: starting both chains from the polished
hand schedule and repairing them on the way (``repair.anneal_repaired``) gives as good orders with
less than half the work on the 24 held-out profiles (benchmarks/results/auto_schedule.md,
"Held-out profiles"), where halving the work alone lost a step on two of them (V, all-to-all 1.0
of F: 192 where 190 is the optimum; dual, latency 0.3: 78.3 against 77.3)."""
ANNEAL_MAX_STEPS = 75_000
"""At most this many steps in that chain, whatever the work (half of what it was with ``ANNEAL_WORK``):
the dual placement's bound, whose cheaper replays would otherwise buy it more steps than the V's."""
WALK_OP_BUDGET = 60_000
"""Randomised walks times ops per schedule when ``iterations`` is not given (200 walks at most,
10 at least): on large problems annealing finds more in the same time than more walks do."""
ANNEAL_CHAINS = 3
"""Annealing chains on small problems (at least ``ANNEAL_CHAIN_STEPS`` steps each), each from one of
the best orders of different makespans found before; larger ones get one longer chain from the best."""
MEDIUM_PROBLEM_OPS = 300
"""Above this many ops (and up to ``SMALL_PROBLEM_OPS``) a problem is medium: its chains are colder
(``anneal_heat``) and longer (``ANNEAL_MEDIUM_STEPS``), and all but the first run in a child process."""
ANNEAL_MEDIUM_STEPS = 20000
"""Steps per chain on medium problems. On the linear placement at P=8, M=24 with uneven stages
(benchmarks/results/auto_schedule.md, "held-out"), three chains of 10 000 steps ended between 99.4 and
101.0 over seeds 0-3 (the hotter two where they started), three cold ones of 20 000 between 98.6 and 99.6."""
ANNEAL_CHAIN_STEPS = 10000
"""Steps per chain on small problems. The 45 small profiles CP-SAT proves
(benchmarks/results/auto_schedule.md, "History"): two end 2.3-2.6 % above the optimum, 40 at it;
with the op budget shared up to 40 000 steps per chain none above 1.85 %, 42 at it, but at 2.2 times
the time (3.3 s per call; the test suite then ran 586 s of its 600), so not by default."""
ANNEAL_HEATS = (ANNEAL_HEAT, 0.025, 0.0125)
"""The start temperature of each chain in turn (a single chain gets the first): which one finds an
instance's optimum varies (on the small proved profiles 0.006 is best most often, on some 0.025
alone finds it), so the chains of a small problem run a portfolio of them."""
HAND_START_MARGIN = 0.05
"""The long chain of a large problem starts from the polished hand schedule unless the phases found an
order this much shorter: on the dual placement with latency 0.3 (P=8, M=24) a list schedule 4 % shorter
than DualPipe annealed to 82, DualPipe to 78 (best known 77.3)."""
CAPS_FULL_RANGE = 64
"""Up to this sum of per-stage limits the caps descent tries every cap value, above it the current +- 2."""


@dataclass
class Candidate:
    """A scored order: makespan, peak activations (max over ranks) and where it came from."""

    ranks: Ranks
    makespan: float
    peak: int
    source: str


@dataclass
class Hand:
    """A hand schedule of the placement with its makespan and per-rank peaks under the costs."""

    name: str
    schedule: Schedule
    makespan: float
    peaks: list[int]


def hand_candidates(layout: Layout, costs: Costs) -> list[Hand]:
    """The hand schedules of this placement that build for (P, M), with makespan and peaks."""
    found = []
    for name in HAND_SCHEDULES[layout.name]:
        try:
            sched = _HAND_BUILDERS[name](layout.P, layout.M)
            res = run_schedule(sched, costs, record=False)
        except Exception:  # noqa: BLE001 - a family that is missing or rejects (P, M) is just not a candidate
            continue
        if sched.placement != layout.placement:
            continue
        found.append(Hand(name, sched, res.makespan, list(res.peak_activations)))
    return found


def default_limit(placement: str, P: int, hands: list[Hand]) -> int:
    """The peak of the leanest hand schedule (P linear, 2P v, P + 1 dual when none builds)."""
    if hands:
        return min(max(h.peaks) for h in hands)
    return {"linear": P, "v": 2 * P, "dual": P + 1}[placement]


def _improves(got: tuple[float, int], best: Candidate | None) -> bool:
    """Lower makespan, or the same makespan and a lower peak."""
    return best is None or got[0] < best.makespan - 1e-9 or (got[0] <= best.makespan + 1e-9 and got[1] < best.peak)


@dataclass
class Search:
    """The best order found so far, under a memory limit and an optional deadline."""

    layout: Layout
    costs: Costs
    limits: list[int]
    deadline: float | None = None
    floor: float = -math.inf  # a lower bound of the makespan (``bound.lower_bound``): reaching it ends the search
    best: Candidate | None = None
    best_ordered: Candidate | None = None  # the best that keeps micro-batch order (what CP-SAT is hinted with)
    out_of_time: bool = False
    walks: int = 0
    scored: list[tuple[float, Policy]] = field(default_factory=list)
    pool: list[Candidate] = field(default_factory=list)  # the best few distinct orders: annealing's starts
    capped: Candidate | None = None  # the best order of the per-stage caps descent: another start
    hand_start: Candidate | None = None  # large problems: the polished best hand schedule, where chains start
    order: tuple[int, ...] | None = None  # uneven micro-batches: which one each slot runs (``costs`` is per slot)

    def make(self, ranks: Ranks) -> Schedule:
        lay = self.layout
        return Schedule("auto", lay.P, lay.M, lay.placement, lay.microbatch_chain, ranks)

    def score(self, ranks: Ranks) -> tuple[float, int] | None:
        """(makespan, max peak) of ``ranks`` by the simulator; None on deadlock or over the limit."""
        try:
            res = run_schedule(self.make(ranks), self.costs, record=False)
        except ScheduleError:
            return None
        if not fits(res.peak_activations, self.limits):
            return None
        return res.makespan, max(res.peak_activations)

    def consider(self, ranks: Ranks | None, source: str) -> float | None:
        """Keep ``ranks`` if better (lower makespan, then lower peak); return its makespan, or None."""
        if ranks is None:
            return None
        got = self.score(ranks)
        if got is None:
            return None
        if _improves(got, self.best):
            self.best = Candidate(ranks, got[0], got[1], source)
        self._pool(Candidate(ranks, got[0], got[1], source))
        if _improves(got, self.best_ordered) and in_microbatch_order(ranks):
            self.best_ordered = Candidate(ranks, got[0], got[1], source)
        return got[0]

    def _pool(self, cand: Candidate) -> None:
        """Keep the ``ANNEAL_CHAINS`` best orders of different makespans (diverse starts for annealing)."""
        pool = self.pool
        if any(abs(c.makespan - cand.makespan) < 1e-9 for c in pool):
            return
        pool.append(cand)
        pool.sort(key=lambda c: (c.makespan, c.peak))
        del pool[ANNEAL_CHAINS:]

    def expired(self) -> bool:
        """True once the deadline passed and a valid order exists, or the best order is at ``floor`` (then
        every phase stops)."""
        if self.best is not None and self.deadline is not None and time.perf_counter() > self.deadline:
            self.out_of_time = True
        return self.out_of_time or self.at_floor()

    def at_floor(self) -> bool:
        """True when the best order's makespan is the lower bound: it is optimal, nothing is left to find."""
        return self.best is not None and self.best.makespan <= self.floor + 1e-9

    def try_policies(self, pols: list[Policy], walk: Callable[[Policy], Ranks | None]) -> None:
        for pol in pols:
            if self.expired():
                return
            got = self.consider(walk(pol), "list")
            if got is not None:
                self.scored.append((got, pol))


def _grid_phase(search: Search, walk: Callable[[Policy], Ranks | None], sc_policies: list[Policy],
                variants: bool = True) -> list[Policy]:
    """The policy grid, then (``variants``) the best six with the critical-path hold and 1F1B-like caps; the
    best six."""
    search.try_policies(sc_policies, walk)
    search.scored.sort(key=lambda x: x[0])
    if variants:
        search.try_policies([replace(p, hold_b=hold, cap=k) for _, p in search.scored[:6] for hold in (False, True)
                             for k in (0, 1, 2) if hold or k], walk)
    search.scored.sort(key=lambda x: x[0])
    return [pol for _, pol in search.scored[:6]]


def _walk_phase(search: Search, top: list[Policy], iterations: int, rng: random.Random,
                walk: Callable[..., Ranks | None]) -> None:
    """Randomised walks: the best policies with random tie-breaking."""
    for _ in range(iterations if top else 0):
        if search.expired():
            return
        pol = top[rng.randrange(len(top))]
        noise = rng.choice((0.05, 0.1, 0.2, 0.35))
        walk_rng = random.Random(rng.getrandbits(32))
        search.walks += 1
        search.consider(walk(pol, walk_rng, noise), "search")


def _local_phase(search: Search, iterations: int, rng: random.Random) -> None:
    if search.expired():
        return
    best = search.best
    steps = max(1000, 10 * iterations) if iterations else 0
    ranks, makespan = local_search(search.layout, search.costs, search.limits, [list(x) for x in best.ranks],
                                   rng, steps, search.deadline)
    if makespan < best.makespan - 1e-9:
        search.consider(ranks, best.source + "+local")
    search.expired()


def _pairing_saves(layout: Layout, costs: Costs) -> bool:
    """True when some rank has two stages and an FB unit can be cheaper than its halves."""
    sc = costs.per_stage(layout.S)
    return any(len(x) > 1 for x in layout.local) and (sc.fb is not None or any(sc.a2a_f) or any(sc.a2a_b))


def _anneal_moves(layout: Layout, costs: Costs) -> tuple[tuple[str, float, Move], ...]:
    """The annealing moves for this problem: with the FB moves only where FB units can pay."""
    return ANNEAL_MOVES if _pairing_saves(layout, costs) else ANNEAL_PLAIN_MOVES


def _fb_phase(search: Search, iterations: int, rng: random.Random,
              walk: Callable[..., Ranks | None], large: bool = False) -> list[Policy]:
    """Polish FB units: every BW split into B then W (never worse), then local search with ``FB_MOVES``.

    What the exact solver's schedules do: FB(F+B) with its W right after or later, so each hop gets
    its gradient one W sooner; swapping the B inside a unit and pushing W's to the cool-down are
    moves the first local search does not have. On a ``large`` problem (whose chains start from the
    hand schedule, ``Search.hand_start``) only the best order is polished, without the FB walks.
    """
    if search.expired() or not _pairing_saves(search.layout, search.costs):
        return []
    top: list[Policy] = []
    if not large:
        search.scored = []
        top = _grid_phase(search, walk, fb_policies(search.layout.name, search.costs.per_stage(search.layout.S)))
        _walk_phase(search, top, iterations // 4, rng, walk)
    best = search.best
    ranks = split_backward(best.ranks)
    search.consider(ranks, best.source + "+split")
    ranks, makespan = sink_ws(search.layout, search.costs, search.limits, ranks, search.deadline)
    search.consider(ranks, best.source + "+sink")
    steps = max(1000, 10 * iterations) if iterations else 0
    ranks, makespan = local_search(search.layout, search.costs, search.limits, ranks, rng, steps,
                                   search.deadline, FB_MOVES)
    if makespan < search.best.makespan - 1e-9:
        search.consider(ranks, best.source + "+fb")
    search.expired()
    return top


def _caps_phase(search: Search, walk: Callable[..., Ranks | None], top: list[Policy], thorough: bool,
                sweeps: int = 2) -> None:
    """Per-stage warm-up depths: coordinate descent on ``Policy.stage_caps``.

    How many micro-batches each stage runs ahead of its first B is what separates the exact
    schedules of odd-P dual placements from every policy of the grid
    (benchmarks/results/auto_schedule.md): one stage starts three micro-batches deep, its neighbour
    two. On small problems (stage limits summing to at most ``CAPS_FULL_RANGE``) every FB policy and
    every cap value up to the rank's limit is tried (without ``thorough``, when ``iterations``
    bounds the search, only the two best policies), on larger ones the two best policies and the
    current cap +- 2. The best order with a cap below a limit is kept in ``search.capped`` as a
    start for annealing even when it is not the best order: its warm-up is what annealing cannot
    build one op at a time.
    ``heuristic`` runs it on two-chain placements and where FB units save time: on V (P = 3, 4) and
    linear (P = 4) placements without (uniform, heavy first or last stage, latency; two memory
    limits each: 24 runs) it changed no result, at up to 45 % of the time (V, P=4, M=16, memory 8:
    3.8 of 8.2 s).
    """
    lay = search.layout
    stage_limit = [search.limits[r] for chain in lay.placement for r in chain]
    small = sum(stage_limit) <= CAPS_FULL_RANGE
    reach = max(stage_limit) if small else 2
    pols = fb_policies(lay.name, search.costs.per_stage(lay.S)) if small and thorough else top[:2]
    for pol in pols:
        caps, ranks = list(stage_limit), walk(pol)
        cur = search.consider(ranks, "caps")
        if cur is None:
            continue
        for _ in range(sweeps):
            improved = False
            for k, lim in enumerate(stage_limit):
                for v in range(max(1, caps[k] - reach), min(lim, caps[k] + reach) + 1):
                    if v == caps[k] or search.expired():
                        continue
                    trial = caps[:k] + [v] + caps[k + 1:]
                    got_ranks = walk(replace(pol, stage_caps=tuple(trial)))
                    got = search.consider(got_ranks, "caps")
                    if got is not None and got < cur - 1e-9:
                        cur, caps, ranks, improved = got, trial, got_ranks, True
            if not improved:
                break
        if caps != stage_limit and (search.capped is None or cur < search.capped.makespan - 1e-9):
            search.capped = Candidate(ranks, cur, 0, "caps")


def op_count(layout: Layout) -> int:
    """F, B and W of every stage and micro-batch: what one simulation of an order walks."""
    return 3 * layout.C * layout.S * layout.M


def anneal_plan(layout: Layout, iterations: int | None) -> tuple[int, int, int | None]:
    """(chains, steps per chain, walked ops per chain or None): ``10 * iterations`` steps in all when given.

    Small problems gain most from diverse starts, larger ones from one long walk (a chain too short
    to cool down finds little): ``ANNEAL_CHAINS`` chains of ``ANNEAL_CHAIN_STEPS`` up to
    ``SMALL_PROBLEM_OPS`` ops, else one chain of up to ``ANNEAL_MAX_STEPS`` steps and
    ``ANNEAL_WORK`` re-simulated ops.
    """
    if iterations is not None:
        total = 10 * iterations
        chains = ANNEAL_CHAINS if total >= ANNEAL_CHAINS * ANNEAL_CHAIN_STEPS else 1
        return chains, total // chains, None
    ops = op_count(layout)
    if ops <= MEDIUM_PROBLEM_OPS:
        return ANNEAL_CHAINS, ANNEAL_CHAIN_STEPS, None
    if ops <= SMALL_PROBLEM_OPS:
        return ANNEAL_CHAINS, ANNEAL_MEDIUM_STEPS, None
    return 1, ANNEAL_MAX_STEPS, ANNEAL_WORK


def anneal_heat(layout: Layout, iterations: int | None, k: int) -> float:
    """The start temperature of chain ``k`` (``ANNEAL_HEATS`` in turn on small problems, ``ANNEAL_HEAT`` on the
    others: on a medium problem the hotter chains ended where they started)."""
    if iterations is None and op_count(layout) > MEDIUM_PROBLEM_OPS:
        return ANNEAL_HEAT
    return ANNEAL_HEATS[k % len(ANNEAL_HEATS)]


def _anneal_phase(search: Search, iterations: int | None, rng: random.Random, workers: int | None = None) -> None:
    """Simulated annealing (backwards split), one seeded chain from each of the first orders of ``search.pool``.

    What hill climbing cannot do (docs/schedules.md): the exact schedules are often a few moves
    away, each of which alone makes the makespan worse (unpair a unit on one rank, move a B on
    another); annealing crosses those. Starting from orders of different makespans, not only the
    best, finds more of them on small problems. Only where FB units pay do the FB moves apply.
    """
    chains, steps, work = anneal_plan(search.layout, iterations)
    if search.expired() or not steps:
        return
    lay, moves = search.layout, _anneal_moves(search.layout, search.costs)
    starts = _anneal_starts(search, chains)  # anneal splits each start's backwards itself
    seeds = [rng.getrandbits(32) for _ in starts]
    if work:  # one long chain: repaired on the way (``repair.anneal_repaired``)
        ranks, makespan = anneal_repaired(lay, search.costs, search.limits, starts[0].ranks, random.Random(seeds[0]),
                                          steps, search.deadline, moves, ANNEAL_HEAT, work, search.floor,
                                          ANNEAL_COLD_REACH, _pairing_saves(lay, search.costs))
        if makespan < search.best.makespan - 1e-9:
            search.consider(ranks, starts[0].source + "+anneal")
        return
    ends_at = None if search.deadline is None else time.time() + (search.deadline - time.perf_counter())
    jobs = [ChainJob(lay, search.costs, list(search.limits), cand.ranks, seed, steps, None,
                     anneal_heat(lay, iterations, k), moves, search.floor, ends_at)
            for k, (cand, seed) in enumerate(zip(starts, seeds))]
    # chains after the first run in a child beside it where the problem is worth a process (medium ones)
    parallel = len(jobs) > 1 and iterations is None and op_count(lay) > MEDIUM_PROBLEM_OPS
    runner = Chains(jobs[1:], (default_workers(len(jobs) - 1) if workers is None else workers) if parallel else 1)
    try:
        ranks, makespan = jobs[0].run()
        if makespan < search.best.makespan - 1e-9:
            search.consider(ranks, starts[0].source + "+anneal")
        for k, (ranks, makespan, _), _ in runner.results(search.expired):
            if makespan < search.best.makespan - 1e-9:
                search.consider(ranks, starts[k + 1].source + "+anneal")
    finally:
        runner.cancel()


def _anneal_starts(search: Search, chains: int) -> list[Candidate]:
    """The first ``chains`` of the pool, and the capped order after them when there are several and it is not
    among them; the one long chain of a large problem starts from the polished hand schedule
    (``Search.hand_start``) unless the phases found an order ``HAND_START_MARGIN`` shorter."""
    hand = search.hand_start
    if chains == 1 and hand is not None and search.best.makespan >= hand.makespan * (1 - HAND_START_MARGIN):
        return [hand]
    starts = search.pool[:chains]
    capped = search.capped
    if chains > 1 and capped is not None and all(c.ranks != capped.ranks for c in starts):
        starts = starts + [capped]
    return starts


ANNEAL_HAND_WORK = 2_000_000
"""Work (as ``ANNEAL_WORK`` counts it) of a chain from the polished hand schedule (``hand_chain_jobs``), at
most ``ANNEAL_MAX_STEPS`` steps: it starts with the search and runs beside its phases (``chains``), so it
gets their time as well (V, P=8, M=24, heavy ends with all-to-all: 4.5-4.9 s with its repairs, the
phases and the search's chain 4.4 s)."""


def polish_hand(search: Search) -> Candidate | None:
    """The best hand schedule that fits with every backward split and its W's pushed late where that does
    not hurt (``local.sink_ws``): where the long chains of a large problem start (``Search.hand_start``).

    From a hand schedule annealing goes further than from a list schedule of about the same makespan
    (the hand schedules' warm-up is what the best orders keep), and the late W's are what annealing,
    one op at a time, hardly builds: on the V placement (P=8, M=24, all-to-all 1.0 of F, half the work
    per chain) a chain from DualPipeV itself ended at 198, from it polished at 195.
    """
    if search.best is None:
        return None
    ranks = split_backward([list(x) for x in search.best.ranks])
    ranks, _ = sink_ws(search.layout, search.costs, search.limits, ranks, search.deadline)
    source = search.best.source + "+sink"
    if search.consider(ranks, source) is None:
        return None
    got = search.score(ranks)
    return Candidate(ranks, got[0], got[1], source)


def hand_chain_jobs(search: Search, seed: int, chains: int) -> list[ChainJob]:
    """``chains`` annealing chains from the polished best hand schedule that fits (``polish_hand``), on large
    problems; [] elsewhere.

    Only without ``iterations`` (``anneal_plan`` gives one long chain) and when that hand schedule is not
    already at the bound. Chain k's seed comes from ``seed`` and k alone, so it does not depend on the
    phases, nor on how many chains run.
    """
    lay = search.layout
    if anneal_plan(lay, None)[0] != 1 or search.best is None or search.at_floor():
        return []
    search.hand_start = polish_hand(search)
    if search.hand_start is None or search.at_floor():
        return []
    moves = _anneal_moves(lay, search.costs)
    ends_at = None if search.deadline is None else time.time() + (search.deadline - time.perf_counter())
    return [ChainJob(lay, search.costs, list(search.limits), [list(x) for x in search.hand_start.ranks],
                     random.Random(f"hand chain {seed}" + (f" {k}" if k else "")).getrandbits(32), ANNEAL_MAX_STEPS,
                     ANNEAL_HAND_WORK, ANNEAL_HEAT, moves, search.floor, ends_at, ANNEAL_COLD_REACH,
                     repair=True, pairing=_pairing_saves(lay, search.costs))
            for k in range(chains)]


def _finish_hand_chains(search: Search, runner: Chains, start: str) -> list[dict]:
    """Read the hand chains in order, keeping each order that is better; what ``meta["hand_chains"]`` says.

    Once the best order is at the bound nothing can beat it: the chains left are not waited for (their
    ``makespan`` is None).
    """
    info = [{"start": start, "makespan": None, "in_child": k < len(runner.started) and runner.started[k].in_child}
            for k in range(len(runner.jobs))]
    for k, (ranks, makespan, repaired), in_child in runner.results(search.at_floor):
        info[k].update(makespan=makespan, in_child=in_child)
        if search.consider(ranks, start + "+anneal") is not None:
            for cand, gain in repaired:  # repaired where the chain ran (``ChainJob.repair``)
                search.consider(cand, start + "+anneal" + gain)
    return info


def _consider_repaired(search: Search, ranks: Ranks, source: str) -> None:
    """Steps 9 and 10: ``ranks`` with its gaps closed (``local.close_gaps``, never worse), its cool-down
    list-scheduled again (``repair.relist_cooldown``) and, where FB units pay, a stray lone F and B of
    the critical rank paired (``repair.pair_strays``), each as a candidate (``repair.repairs``)."""
    for cand, gain in repairs(search.layout, search.costs, search.limits, ranks, search.floor,
                              _pairing_saves(search.layout, search.costs), search.deadline):
        search.consider(cand, source + gain)


def check_options(costs: object, seed: object, time_budget: object,
                  iterations: object, chains: object = 1, workers: object = None) -> None:
    """``ScheduleError`` naming the first bad option and what is allowed."""
    if not isinstance(costs, Costs):
        raise ScheduleError(f"costs must be a mt_dualpipe.schedules.Costs, got {type(costs).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ScheduleError(f"seed must be an integer, got {seed!r}")
    if time_budget is not None and not (isinstance(time_budget, (int, float)) and time_budget > 0):
        raise ScheduleError(f"time_budget must be a positive number of seconds or None, got {time_budget!r}")
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int)
                                   or iterations < 0):
        raise ScheduleError(f"iterations must be a non-negative integer or None, got {iterations!r}")
    if isinstance(chains, bool) or not isinstance(chains, int) or chains < 0:
        raise ScheduleError(f"chains must be a non-negative integer (annealing chains from the best hand schedule), "
                            f"got {chains!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ScheduleError(f"workers must be a positive integer (processes the search may use) or None, "
                            f"got {workers!r}")


def heuristic(layout: Layout, costs: Costs, memory_limit: int | Sequence[int] | None, seed: int,
              time_budget: float | None, iterations: int | None, chains: int = 1,
              workers: int | None = None) -> tuple[Search, dict]:
    """Run the phases; the search (its best order) and the ``meta`` entries that describe it.

    On large problems ``chains`` annealing chains from the best hand schedule (``hand_chain_jobs``)
    run in child processes beside the phases as far as ``workers`` (default
    ``chains.default_workers``) allows, else here after them; the result is the same.
    """
    started = time.perf_counter()
    P = layout.P
    hands = hand_candidates(layout, costs)
    limit_value = default_limit(layout.name, P, hands) if memory_limit is None else memory_limit
    limits = memory_limits(limit_value, P)
    if min(limits) < layout.min_limit:
        raise ScheduleError(f"memory_limit {limit_value!r} is too small for placement {layout.name!r}: a micro-batch "
                            f"needs {layout.min_limit} activation slot(s) on one rank; allowed: >= {layout.min_limit}")
    baselines: dict[str, dict] = {}
    for h in hands:
        fits = all(p <= lim for p, lim in zip(h.peaks, limits))
        baselines[h.name] = {"makespan": h.makespan, "peak_activations": max(h.peaks), "fits": fits}
    floor = lower_bound(layout, costs)  # holds whichever slot each micro-batch takes
    arrival = (costs, hands)
    order, order_info = None, None
    if costs.uneven:  # choose which micro-batch each slot runs; the search then sees the costs per slot
        order, order_info = choose_order(layout, costs, limits, [h.schedule for h in hands])
        costs = slot_costs(costs, order)
        hands = hand_candidates(layout, costs)
    search = Search(layout, costs, limits, None if time_budget is None else started + time_budget, floor)
    search.order = order
    for h in hands:
        if all(p <= lim for p, lim in zip(h.peaks, limits)):
            search.consider([list(ops) for ops in h.schedule.ranks], h.name)
    jobs = hand_chain_jobs(search, seed, chains) if iterations is None else []
    hand_start = search.hand_start.source if jobs else ""
    runner = Chains(jobs, default_workers(len(jobs)) if workers is None else workers)
    try:
        _phases(search, layout, costs.per_stage(layout.S), seed, iterations, limit_value, workers)
        if search.best is not None and not search.expired():  # expired: past the deadline or at the bound
            _consider_repaired(search, search.best.ranks, search.best.source)
        hand = _finish_hand_chains(search, runner, hand_start)
    finally:
        runner.cancel()
    meta = {"memory_limit": limit_value, "baselines": baselines, "walks": search.walks, "hand_chains": hand,
            "search_seconds": round(time.perf_counter() - started, 3), "stopped_by_time_budget": search.out_of_time}
    if order is not None:
        meta["microbatch_order"] = {**order_info, **_settle_order(search, *arrival)}
    return search, meta


def _settle_order(search: Search, costs: Costs, hands: list[Hand]) -> dict:
    """Uneven micro-batches: the micro-batches exchanged once more on the search's best order
    (``order.improve_order``), then the best hand schedule in arrival order if it is still better
    (so ``auto`` never loses to running the step as it comes); ``search`` is left per slot of its order."""
    best = search.best
    order, makespan = improve_order(search.layout, costs, search.limits, best.ranks, search.order)
    if makespan < best.makespan - 1e-9:
        search.order, search.best = order, Candidate(best.ranks, makespan, best.peak, best.source + "+order")
    arrival = min((h for h in hands if all(p <= lim for p, lim in zip(h.peaks, search.limits))),
                  key=lambda h: h.makespan, default=None)
    if arrival is not None and arrival.makespan < search.best.makespan - 1e-9:
        search.order = None
        search.best = Candidate([list(x) for x in arrival.schedule.ranks], arrival.makespan, max(arrival.peaks),
                                arrival.name + " (arrival order)")
    return {"order": list(search.order or range(search.layout.M)), "makespan": search.best.makespan}


def _phases(search: Search, layout: Layout, sc: StageCosts, seed: int, iterations: int | None,
            limit_value: object, workers: int | None = None) -> None:
    """The list-scheduling grid, walks, local search, FB polish, caps and annealing, in that order."""
    P, M, limits, costs = layout.P, layout.M, search.limits, search.costs
    table = OpTable(layout.placement, M, sc)

    def walk(pol: Policy, rng: random.Random | None = None, noise: float = 0.0) -> Ranks | None:
        return list_schedule(layout, sc, limits, pol, rng, noise, table)

    # a large problem's chains start from the polished hand schedule (``Search.hand_start``): its phases
    # only look for an order far better than that, without the variants, random walks, FB walks and caps
    large = iterations is None and anneal_plan(layout, None)[0] == 1
    top = _grid_phase(search, walk, policies(layout.name, sc), variants=not large)
    if search.best is None:
        raise ScheduleError(f"auto found no schedule for P={P}, M={M}, placement={layout.name!r} within "
                            f"memory_limit={limit_value!r}")
    given = iterations
    if iterations is None:
        iterations = max(10, min(200, layout.C * layout.S * M * P // 8, WALK_OP_BUDGET // op_count(layout)))
    rng = random.Random(seed)
    _walk_phase(search, top, 0 if large else iterations, rng, walk)
    _local_phase(search, iterations, rng)
    fb_top = _fb_phase(search, iterations, rng, walk, large)
    if iterations and not large and (layout.C > 1 or _pairing_saves(layout, costs)):  # iterations=0: the grid only
        _caps_phase(search, walk, fb_top, thorough=given is None)
    _anneal_phase(search, given, rng, workers)
