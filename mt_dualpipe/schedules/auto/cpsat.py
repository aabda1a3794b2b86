"""An exact backend for ``auto``: the scheduling problem as a CP-SAT model (OR-Tools).

The model has the simulator's rules, read from ``ops`` so that it cannot drift from them:

* every rank runs one item at a time (a no-overlap constraint over its intervals);
* an op starts after each input it waits for (``OpTable.waits``) ends, plus the hop latency when
  the producer runs on another rank;
* lone ops cost what ``ops`` says (exposed all-to-all included); an F and a B of different local
  stages may run as one FB unit costing ``StageCosts.fb_cost``;
* activations: one unit from an F's start to the end of its W, at most the limit per rank
  (a cumulative constraint).

Backwards are modelled split (B, then W): a fused BW is never better than its B followed at once
by its W (same times, same memory release), so the optimum over split schedules is the optimum.
Micro-batches of a chain keep their order per (stage, kind) — the symmetry the issue's study
found costs nothing — which the list-scheduling walks also assume.

Costs are scaled to integers; when they are not exact multiples of 1/``scale`` they are rounded
down, so the solver's bound stays a valid lower bound, and every schedule found is re-simulated
with the exact costs (the makespan reported is always the simulator's).

The search is warm-started from the heuristic's best order that keeps micro-batch order
(``hint``) and runs as one sequential CP-SAT search under a deterministic time limit
(``DETERMINISTIC_PER_SECOND`` units per second of ``time_limit``), so a seed gives one result
unless the wall-clock cap (``time_limit`` itself) stops it first on a slow machine
(``meta["solver_deterministic_time"]`` tells). The proven bound assumes micro-batch order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

from ..costs import Costs, StageCosts
from ..errors import ScheduleError
from ..ir import FB, ComputeItem, Op, Schedule
from ..ops import OpKind, OpTable
from ..simulate import run_schedule
from .layout import Layout
from .local import in_microbatch_order, split_backward

INSTALL_HINT = "solver='cpsat' needs OR-Tools: pip install mt_dualpipe[solver]"
DETERMINISTIC_PER_SECOND = 0.3
"""CP-SAT deterministic time units allowed per second of ``time_limit``: about what one idle core of a
2026 server does (0.3-0.45 measured); on a busier machine the wall-clock cap stops the search first."""
SCALES = (1, 2, 4, 5, 8, 10, 20, 25, 50, 100, 1000)


def load_cp_model():
    """The ``ortools.sat.python.cp_model`` module, or a ``ScheduleError`` saying how to install it."""
    try:
        from ortools.sat.python import cp_model  # lazy: OR-Tools is optional (the cpsat extra)
    except ImportError as exc:
        raise ScheduleError(INSTALL_HINT) from exc
    return cp_model


def cost_scale(sc: StageCosts) -> tuple[int, bool]:
    """The smallest scale that makes every cost an integer, and True; else (1000, False)."""
    values = [v for f in fields(sc) if f.name != "dp_sync" for v in (getattr(sc, f.name) or [])]  # no REDUCE_GRAD here
    for k in SCALES:
        if all(abs(v * k - round(v * k)) < 1e-9 for v in values):
            return k, True
    return SCALES[-1], False


@dataclass
class CpResult:
    """What the solver found: the order (None if none), its bound and status."""

    ranks: list[list[ComputeItem]] | None
    bound: float
    proved: bool
    status: str
    seconds: float
    stats: dict = field(default_factory=dict)


class _Model:
    """The CP-SAT variables and constraints of one (layout, costs, limits) problem."""

    def __init__(self, cp_model, layout: Layout, sc: StageCosts, limits: list[int], scale: int, horizon: int,
                 in_order: bool = True, floor: float = 0.0):
        self.cp, self.layout, self.sc, self.scale = cp_model, layout, sc, scale
        self.m = cp_model.CpModel()
        self.table = OpTable(layout.placement, layout.M, sc)
        self.horizon = horizon
        self.start: dict[Op, object] = {}
        self.end: dict[Op, object] = {}
        self.lone: dict[Op, object] = {}
        self.pairs: dict[tuple[Op, Op], object] = {}
        self.act_size: dict[Op, object] = {}
        self.rank_ops: list[list[Op]] = [[] for _ in range(layout.P)]
        self.intervals: list[list[object]] = [[] for _ in range(layout.P)]
        self._ops()
        self._precedence()
        self._pairs()
        self._memory(limits)
        if in_order:
            self._order()
        self.makespan = self.m.NewIntVar(min(horizon, int(math.floor(floor * scale + 1e-9))), horizon, "makespan")
        self.m.AddMaxEquality(self.makespan, [self.end[op] for ops in self.rank_ops for op in ops])
        self.m.Minimize(self.makespan)

    def dur(self, value: float) -> int:
        return int(math.floor(value * self.scale + 1e-9))

    def _ops(self) -> None:
        lay, m, H = self.layout, self.m, self.horizon
        for c, chain in enumerate(lay.placement):
            for s, r in enumerate(chain):
                for mb in lay.chain_mbs[c]:
                    for kind in (OpKind.F, OpKind.B, OpKind.W):
                        op = Op(kind, c, s, mb)
                        st = m.NewIntVar(0, H, f"s_{kind}{c}_{s}_{mb}")
                        en = m.NewIntVar(0, H, f"e_{kind}{c}_{s}_{mb}")
                        self.start[op], self.end[op] = st, en
                        self.rank_ops[r].append(op)
                        d = self.dur(self.table.cost(op))
                        if kind == OpKind.W:
                            self.intervals[r].append(m.NewIntervalVar(st, d, en, f"i_{op}"))
                        else:
                            lone = m.NewBoolVar(f"lone_{op}")
                            self.lone[op] = lone
                            self.intervals[r].append(m.NewOptionalIntervalVar(st, d, en, lone, f"i_{op}"))

    def _precedence(self) -> None:
        """Each op starts after what it waits for (``OpTable.waits``) ends, plus the hop latency across ranks."""
        lat, table = self.sc.comm, self.table
        maker = {table.made(op): op for ops in self.rank_ops for op in ops if table.made(op) >= 0}
        for r, ops in enumerate(self.rank_ops):
            for op in ops:
                for key, owner, st in table.waits(op):
                    hop = self.dur(lat[st]) if owner != r else 0
                    self.m.Add(self.start[op] >= self.end[maker[key]] + hop)

    def _pairs(self) -> None:
        """One optional FB interval per (F, B) of different local stages; each op in at most one unit.

        Only pairs whose FB unit is cheaper than F then B: otherwise running them apart is never worse.
        """
        m = self.m
        for r, ops in enumerate(self.rank_ops):
            fs = [op for op in ops if op.kind == OpKind.F]
            bs = [op for op in ops if op.kind == OpKind.B]
            used: dict[Op, list] = {op: [] for op in fs + bs}
            for f in fs:
                for b in bs:
                    if (f.chain, f.stage) == (b.chain, b.stage):
                        continue
                    d = self.dur(self.sc.fb_cost(f.stage, OpKind.B, b.stage))
                    if d >= self.dur(self.table.cost(f)) + self.dur(self.table.cost(b)):
                        continue  # no cheaper than F then B, which also releases F's output sooner
                    x = m.NewBoolVar(f"x_{f}_{b}")
                    self.intervals[r].append(m.NewOptionalIntervalVar(self.start[f], d, self.end[f], x, f"fb_{f}_{b}"))
                    m.Add(self.start[b] == self.start[f]).OnlyEnforceIf(x)
                    m.Add(self.end[b] == self.end[f]).OnlyEnforceIf(x)
                    self.pairs[(f, b)] = x
                    used[f].append(x)
                    used[b].append(x)
            for op, xs in used.items():
                m.Add(sum(xs) + self.lone[op] == 1)
            m.AddNoOverlap(self.intervals[r])

    def _memory(self, limits: list[int]) -> None:
        m = self.m
        for r, ops in enumerate(self.rank_ops):
            acts = []
            for op in ops:
                if op.kind != OpKind.F:
                    continue
                w = Op(OpKind.W, *op[1:])
                size = m.NewIntVar(0, self.horizon, f"act_{op}")
                self.act_size[op] = size
                acts.append(m.NewIntervalVar(self.start[op], size, self.end[w], f"a_{op}"))
            m.AddCumulative(acts, [1] * len(acts), limits[r])

    def _order(self) -> None:
        """Micro-batches of a chain in order per (stage, kind): symmetry breaking."""
        lay = self.layout
        for c, chain in enumerate(lay.placement):
            mbs = lay.chain_mbs[c]
            for s in range(len(chain)):
                for kind in (OpKind.F, OpKind.B, OpKind.W):
                    for a, b in zip(mbs, mbs[1:]):
                        self.m.Add(self.start[Op(kind, c, s, a)] <= self.start[Op(kind, c, s, b)])

    def hint(self, ranks: list[list[ComputeItem]], costs: Costs) -> None:
        """Warm start from an order (split first): its simulated times, its FB pairs."""
        sched = Schedule("hint", self.layout.P, self.layout.M, self.layout.placement, self.layout.microbatch_chain,
                         split_backward(ranks))
        starts: list[list[float]] = [[] for _ in ranks]
        ends: list[list[float]] = [[] for _ in ranks]
        run_schedule(sched, costs, record=False, starts_out=starts, ends_out=ends)
        times: dict[Op, tuple[float, float]] = {}
        paired = set()
        for r, ops in enumerate(sched.ranks):
            for item, t0, t1 in zip(ops, starts[r], ends[r]):
                if type(item) is FB and (item.f, item.b) in self.pairs:
                    paired.add((item.f, item.b))
                    times[item.f] = times[item.b] = (t0, t1)
                elif type(item) is FB:  # a unit the model leaves out: F then B in the same time, never later
                    mid = t0 + self.table.cost(item.f)
                    times[item.f], times[item.b] = (t0, mid), (mid, t1)
                else:
                    times[item] = (t0, t1)
        for op, (t0, t1) in times.items():
            self.m.AddHint(self.start[op], int(round(t0 * self.scale)))
            self.m.AddHint(self.end[op], int(round(t1 * self.scale)))
        for key, x in self.pairs.items():
            self.m.AddHint(x, key in paired)
        for op, lone in self.lone.items():
            self.m.AddHint(lone, not any(op in key for key in paired))
        for op, size in self.act_size.items():
            w = Op(OpKind.W, *op[1:])
            self.m.AddHint(size, int(round((times[w][1] - times[op][0]) * self.scale)))
        self.m.AddHint(self.makespan, int(round(max(max(e, default=0.0) for e in ends) * self.scale)))

    def extract(self, solver) -> list[list[ComputeItem]]:
        """The per-rank order of a solution: its items sorted by start time."""
        out = []
        by_rank: list[list[tuple[Op, Op, object]]] = [[] for _ in self.rank_ops]
        for (f, b), x in self.pairs.items():
            by_rank[self.layout.placement[f.chain][f.stage]].append((f, b, x))
        for r, ops in enumerate(self.rank_ops):
            items: list[tuple[int, int, int, ComputeItem]] = []
            for op in ops:
                if op.kind == OpKind.W or solver.Value(self.lone[op]):
                    items.append((solver.Value(self.start[op]), solver.Value(self.end[op]), len(items), op))
            for f, b, x in by_rank[r]:
                if solver.Value(x):
                    items.append((solver.Value(self.start[f]), solver.Value(self.end[f]), len(items), FB(f, b)))
            items.sort(key=lambda x: x[:3])
            out.append([it[3] for it in items])
        return out


def solve(layout: Layout, costs: Costs, limits: list[int], hint: list[list[ComputeItem]], hint_makespan: float,
          time_limit: float, seed: int, floor: float = 0.0) -> CpResult:
    """Solve the exact model within ``time_limit`` seconds, warm-started from ``hint``.

    ``floor`` is a known lower bound on the makespan (``bound.lower_bound``), given to the model.
    Micro-batch order is imposed only when the hint keeps it (else the hint would be infeasible).
    """
    cp_model = load_cp_model()
    started = time.perf_counter()
    sc = costs.per_stage(layout.S)
    scale, exact = cost_scale(sc)
    horizon = int(math.ceil(hint_makespan * scale)) + 1
    in_order = in_microbatch_order(hint)
    model = _Model(cp_model, layout, sc, limits, scale, horizon, in_order, floor)
    model.hint(hint, costs)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1  # one sequential search: deterministic under the deterministic limit
    p.random_seed = seed
    p.cp_model_probing_level = 0  # probing costs seconds on these models and proves little
    p.max_deterministic_time = time_limit * DETERMINISTIC_PER_SECOND
    p.max_time_in_seconds = max(0.0, time_limit - (time.perf_counter() - started))
    status = solver.Solve(model.m)
    name = solver.StatusName(status)
    bound = solver.BestObjectiveBound() / scale
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    ranks = model.extract(solver) if found else None
    stats = {"scale": scale, "exact_costs": exact, "microbatch_order": in_order,
             "deterministic_time": round(solver.deterministic_time, 3),
             "branches": solver.num_branches}
    return CpResult(ranks, bound, status == cp_model.OPTIMAL, name, time.perf_counter() - started, stats)
