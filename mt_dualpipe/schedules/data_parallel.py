"""Data-parallel gradient reduction as part of the schedule: one ``REDUCE_GRAD`` per stage.

A stage's weight gradients are final once its last W (or BW) of the step has run on its rank.
Reducing them right there — instead of after the whole step — lets the data-parallel collective
overlap the rest of the pipeline's drain (ZB's and DualPipe's W tails are long). This pass makes
that point explicit in the schedule, so the simulator can price it (``Costs.dp_sync``, exposed
only where it outlasts the rank's remaining compute), the diagrams can draw it and the runtime
executes it as one more op kind. Every chain's copy of a stage (DualPipe's mirrored stages) is
summed by the same collective; ``ops.RULES[REDUCE_GRAD]`` says what the op means.
"""

from __future__ import annotations

from dataclasses import replace

from .errors import ScheduleError
from .ir import ComputeItem, Op, Schedule
from .ops import REDUCE_GRAD, STAGE_KINDS, WEIGHT_GRAD_KINDS, parts

WHEN = ("last_w", "step_end")


def add_grad_reduction(schedule: Schedule, when: str = "last_w") -> Schedule:
    """A copy of ``schedule`` with one ``REDUCE_GRAD(c, s)`` per local stage on every rank.

    ``when="last_w"`` puts each right after the last W/BW of its stage (the overlapped placement);
    ``"step_end"`` puts them all after the rank's last op — what a sync after ``step()`` does,
    kept to measure the difference. Idempotent: a schedule that already has its reductions is
    returned unchanged.
    """
    if when not in WHEN:
        raise ScheduleError(f"when={when!r}: allowed {', '.join(WHEN)}")
    if has_grad_reduction(schedule):
        return schedule
    ranks: list[list[ComputeItem]] = []
    for r, ops in enumerate(schedule.ranks):
        last = last_weight_grads(ops)
        missing = set(schedule.local_stages(r)) - set(last)
        if missing:
            c, s = sorted(missing)[0]
            raise ScheduleError(f"rank {r}: stage (c{c},s{s}) has no W or BW, so its gradient is never final")
        after: dict[int, list[Op]] = {}
        for (c, s), i in sorted(last.items(), key=lambda kv: (kv[1], kv[0])):
            after.setdefault(i if when == "last_w" else len(ops) - 1, []).append(Op(REDUCE_GRAD, c, s, 0))
        out: list[ComputeItem] = []
        for i, item in enumerate(ops):
            out.append(item)
            out.extend(after.get(i, ()))
        ranks.append(out)
    return replace(schedule, ranks=ranks, meta={**schedule.meta, "data_parallel": True})


def last_weight_grads(ops: list[ComputeItem]) -> dict[tuple[int, int], int]:
    """For one rank's ops: (chain, stage) -> index of the last item holding a W or BW of that stage."""
    last: dict[tuple[int, int], int] = {}
    for i, item in enumerate(ops):
        for op in parts(item):
            if op.kind in WEIGHT_GRAD_KINDS:
                last[(op.chain, op.stage)] = i
    return last


def has_grad_reduction(schedule: Schedule) -> bool:
    """True when any rank of ``schedule`` carries stage-level ops such as ``REDUCE_GRAD``."""
    return any(type(item) is Op and item.kind in STAGE_KINDS for ops in schedule.ranks for item in ops)


def reduction_order(schedule: Schedule, rank: int) -> list[tuple[int, int]]:
    """The (chain, stage) pairs whose gradients ``rank`` reduces, in the order it posts them."""
    return [(item.chain, item.stage) for item in schedule.ranks[rank]
            if type(item) is Op and item.kind == REDUCE_GRAD]
