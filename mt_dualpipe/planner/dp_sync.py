"""Data-parallel gradient sync of a strategy, priced per pipeline stage for the simulator.

The planner no longer adds the whole sync to the step as if nothing hid it. Each stage's
gradient reduction becomes one ``REDUCE_GRAD`` op right after that stage's last W/BW on its rank
(``schedules.add_grad_reduction``) and its time is ``Costs.dp_sync[stage]``; the simulator runs it
on the rank's communication stream, so only what outlasts the rank's remaining compute lengthens
the step — the same simulation the diagrams draw (``mt-dualpipe show --dp-sync``).

What one stage's reduction moves (ring collectives, ``(g - 1) / g`` of the data per pass, one
latency per collective):

* its dense (non-expert) gradients over the data-parallel group (``dp`` ranks in Megatron's
  convention, the planner's), its routed-expert gradients (``1/ep`` of them per rank) over the
  expert-data-parallel group (``dp / ep`` ranks) — see ``parallel/mesh.py`` for the same groups;
* a stage held by several chains (DualPipe's mirrored stages: pipeline ranks r and P-1-r hold the
  same layers) is summed over every copy in the same collective, so its groups are ``copies``
  times larger (``parallel/mesh.py``'s mirrored-stage groups);
* the mode is the runtime's for the strategy's ZeRO stage (``parallel.modes``): ``zero = 0``
  (``allreduce``): one all-reduce, two passes of BF16 values (reduce-scatter + all-gather), all
  inside the schedule; ``zero = 1`` (``zero1``): the reduce-scatter (one pass) is the
  ``REDUCE_GRAD``; the all-gather of the updated parameters comes after the optimizer step and is
  counted as exposed (``param_gather_time``); ``zero = 3`` (``fsdp``): the same reduce-scatter, but
  a mirrored stage's copies are all-reduced (two passes: ``FSDPStageSync`` cannot hand one chunk to
  two copies), and the parameters' all-gather runs when the next step unshards the stages —
  counted once per step like zero1's, and exposed in full: the executor calls every local stage's
  ``begin_step()`` before the step's first op and each waits for its all-gather
  (``parallel/fsdp.py``), so no compute overlaps it. FSDP posts no all-gather after the optimizer
  step (its parameters stay sharded until the next step's start).

Ranks are laid out data-parallel innermost (``parallel/mesh.py``'s order with tp = 1), so a
group leaves the node when ``dp`` exceeds a node; a mirrored group also spans pipeline ranks,
which share a node only when the whole ``pp x dp`` block fits in one.
"""

from __future__ import annotations

from ..parallel.modes import mode_for_zero_stage
from ..schedules.ir import Schedule
from .model import Item
from .strategy import Strategy
from .system import SystemSpec


def grad_comm_bytes(strategy: Strategy) -> float:
    """Bytes per gradient value on the wire: BF16, or FP32 for plain FP32 training."""
    return 4.0 if strategy.dtype == "fp32" else 2.0


def copies_of_stage(schedule: Schedule) -> int:
    """How many pipeline ranks hold each stage: one per chain (DualPipe's two chains mirror each other)."""
    return len(schedule.placement)


def _link(strategy: Strategy, system: SystemSpec, copies: int) -> tuple[float, float]:
    # consecutive ranks one group covers (tensor parallel innermost, then data parallel)
    span = strategy.dp * strategy.tp * (strategy.pp if copies > 1 else 1)
    return system.link(span > system.gpus_per_node)


def ring_time(values: float, group: int, passes: int, value_bytes: float, link: tuple[float, float]) -> float:
    """``passes`` ring passes (reduce-scatter, all-gather) of ``values`` over ``group`` ranks; 0 for one rank."""
    if group <= 1 or values <= 0:
        return 0.0
    bw, lat = link
    return passes * (values * value_bytes * (group - 1) / group / bw + lat)


def _stage_values(strategy: Strategy, items: list[Item]) -> tuple[float, float]:
    """(dense, expert) gradient values of one stage on one rank (dense: its 1/tp share; experts: its 1/ep)."""
    return sum(i.params for i in items) / strategy.tp, sum(i.expert_params for i in items) / strategy.ep


def stage_sync_times(strategy: Strategy, system: SystemSpec, stages: list[list[Item]], schedule: Schedule
                     ) -> list[float]:
    """``schedules.Costs.dp_sync``: seconds of each stage's ``REDUCE_GRAD`` (all-reduce, or a reduce-scatter)."""
    copies = copies_of_stage(schedule)
    link = _link(strategy, system, copies)
    mode = mode_for_zero_stage(strategy.zero)
    mirrored_fsdp = mode.shards_parameters and copies > 1  # all-reduced, then each copy keeps its chunk
    passes = 1 if mode.reduces_by == "reduce_scatter" and not mirrored_fsdp else 2
    edp = max(1, strategy.dp // strategy.ep)
    out = []
    for items in stages:
        dense, expert = _stage_values(strategy, items)
        out.append(ring_time(dense, strategy.dp * copies, passes, grad_comm_bytes(strategy), link)
                   + ring_time(expert, edp * copies, passes, grad_comm_bytes(strategy), link))
    return out


def param_gather_time(strategy: Strategy, system: SystemSpec, stages: list[list[Item]], schedule: Schedule
                      ) -> float:
    """The all-gather of the updated parameters (0 without sharding): ZeRO-1's after the optimizer step,
    FSDP's when the next step unshards; the most loaded rank's, over the reduce-scatter's groups
    (FSDP's over its own dp mesh: each mirrored copy gathers its own shards); nothing hides it."""
    mode = mode_for_zero_stage(strategy.zero)
    if not mode.shards_optimizer_state:
        return 0.0
    copies = 1 if mode.shards_parameters else copies_of_stage(schedule)
    link = _link(strategy, system, copies)
    edp = max(1, strategy.dp // strategy.ep)
    worst = 0.0
    for r in range(schedule.num_ranks):
        total = 0.0
        for _, s in schedule.local_stages(r):
            dense, expert = _stage_values(strategy, stages[s])
            total += ring_time(dense, strategy.dp * copies, 1, grad_comm_bytes(strategy), link)
            total += ring_time(expert, edp * copies, 1, grad_comm_bytes(strategy), link)
        worst = max(worst, total)
    return worst
