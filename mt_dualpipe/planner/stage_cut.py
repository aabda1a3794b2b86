"""Blocks per pipeline stage, balanced per rank by a modelled cost: the one cut the planner assumes and
the DeepSeek-V3 runtime builds.

Counting blocks is not enough: the first stage also runs the embedding and the last one the final
norm, the output head, the MTP modules and the losses — at the tiny DeepSeek-V3 preset the last
stage's extras cost about two MoE blocks. V schedules (ZB-V, DualPipeV) make it worse, since rank 0
holds both the first and the last stage. So every piece gets a modelled cost — its forward FLOPs
per token (``ModelSpec.items``: GEMMs and core attention) plus the element-wise work the FLOPs
leave out (the embedding gather / scatter-add and the softmax cross-entropy over the vocabulary) —
and the layout minimises, in this order, the heaviest rank (a rank's load is the sum of its stages,
each weighted by the share of micro-batches its chain carries), the heaviest stage, then the rest
of the sorted loads. Small problems are searched exhaustively; large ones (61 blocks over 16 or 32
stages) by moving blocks across stage boundaries while that improves the loads.

Schedules with F&B units (DualPipe, DualPipeV: ``ScheduleInfo.fb_units``) add one rule. A unit pairs
the forward of one stage a rank holds with the backward of its other stage, and hides one side's expert
all-to-alls only behind the other side's work (``runtime/overlap.py``). A stage with no block (only the
embedding, or only the head) has no work to hide them behind; yet the cost balance gives exactly that to
the first stage at the tiny preset ([0, 2, 1, 1] on DualPipeV at pp 2: the last stage's block and MTP
module make rank 0 heavy), and then none of rank 0's all-to-alls is hidden. So under F&B units a stage
paired with one that holds MoE blocks must hold a block itself (the MTP module counts as one), when a
layout allows it without leaving more stages between the first and the last empty (a few layers on many
stages: 4 blocks on DualPipe's 6 stages fill the middle four only if stage 0 keeps the embedding alone).
There the cut becomes [1, 1, 2, 0], and ``benchmarks/moe_overlap.py`` (pp 2 x ep 2, 4 ms per all-to-all)
measures an exposed fraction of 0.24-0.37 over runs instead of 0.53-0.55. Asking more, that both stages of
a pair communicate, gives 0.17 there ([2, 1, 1, 0]) but at 671B on DualPipeV at pp 16 would put the three
dense blocks and an MoE block on stage 0 beside the MTP module on the same rank, about half as much again
as any other rank's work; the rule as it stands changes no cut at real scale.

Why the planner takes this cut rather than its own chain partition (``estimate.stage_items``): the
memory it reports must be the memory of the stages the runtime builds
(``models/deepseek_v3/stages.py``: ``stages_for_rank`` calls ``balance`` through
``stage_balance.balanced_layout``). Memory is not in the objective, but the cut is what makes
DeepSeek-V3's published layout fit: the ranks that hold the embedding, the head and the MTP modules
get fewer blocks (DualPipe at 671B: 5 on ranks 0 and 15, 8 elsewhere), and the heaviest-stage rule
leaves the first stage, whose micro-batches DualPipe keeps longest in flight, 4 of them where a cut
balanced along the chain gives it 5 and the tail none (rank 0: 70.0 GB instead of 80.1 GB with
every saver on; the fullest ranks are then the middle ones, 74.2 GB).

Torch-free (``ModelSpec`` only), so the planner and the runtime share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate
from math import comb

from .model import ModelSpec

EXHAUSTIVE_LIMIT = 20000  # layouts; above this the boundary-move search runs
LOSS_FLOPS_PER_CLASS = 5.0  # softmax cross-entropy per vocabulary entry: max, sub, exp, sum, log-sum
EMBED_FLOPS_PER_DIM = 2.0   # gather forward, scatter-add backward

Placement = Sequence[Sequence[int]]


def cuts_per_rank(model: ModelSpec) -> bool:
    """Whether the runtime cuts ``model``'s stages with ``balance``: the DeepSeek-V3 family (MLA attention,
    ``models/deepseek_v3/stage_balance.py``). Other families keep the planner's chain partition."""
    return model.attention_type == "mla"


@dataclass(frozen=True)
class PieceCosts:
    """Modelled forward cost per token (FLOP-equivalents) of the pieces a stage may hold."""

    embedding: float
    blocks: tuple[float, ...]
    tail: float  # final norm, output head, MTP modules (their own embedding lookup included) and every loss
    moe_blocks: tuple[bool, ...] = ()  # which blocks post expert all-to-alls (empty: none)
    tail_block: bool = False  # the tail holds a block (an MTP module)
    moe_tail: bool = False  # ... an MoE one

    def stage_work(self, counts: Sequence[int]) -> list[tuple[bool, bool]]:
        """Per stage of ``counts`` blocks per stage: (holds a block, holds an MoE block: expert all-to-alls)."""
        bounds = list(accumulate(counts, initial=0))
        out = [(hi > lo, any(self.moe_blocks[lo:hi])) for lo, hi in zip(bounds, bounds[1:])]
        out[-1] = (out[-1][0] or self.tail_block, out[-1][1] or self.moe_tail)
        return out

    @cached_property
    def prefix(self) -> tuple[float, ...]:
        """Running sums of the block costs (``prefix[j]``: blocks 0..j-1), for a stage's cost in O(1)."""
        return tuple(accumulate(self.blocks, initial=0.0))

    @property
    def total(self) -> float:
        return self.embedding + sum(self.blocks) + self.tail


def piece_costs(model: ModelSpec, seq_len: int) -> PieceCosts:
    """The modelled cost of the embedding, each block and the tail (head + MTP + losses) at ``seq_len``."""
    items = model.items(seq_len)
    flops = [i.mm_flops + i.attn_flops for i in items]
    embed = EMBED_FLOPS_PER_DIM * model.hidden_size
    losses = (1 + model.mtp_depth) * LOSS_FLOPS_PER_CLASS * model.vocab_size
    tail = flops[-1] + losses + (embed if model.mtp_depth else 0.0)
    return PieceCosts(flops[0] + embed, tuple(flops[1:-1]), tail, tuple(i.moe for i in items[1:-1]),
                      model.mtp_depth > 0, items[-1].moe)


def unit_pairs(placement: Placement) -> tuple[tuple[int, int], ...]:
    """The stage pairs F&B units join: the two stages each rank holds (a V's stage r and 2P-1-r, DualPipe's
    stage r of one chain and P-1-r of the other)."""
    held: dict[int, list[int]] = {}
    for chain in placement:
        for s, r in enumerate(chain):
            held.setdefault(r, []).append(s)
    return tuple((stages[0], stages[1]) for stages in held.values() if len(stages) == 2)


def _overlappable(costs: PieceCosts, pairs: tuple[tuple[int, int], ...]) -> Callable[[Sequence[int]], bool]:
    """Whether a layout gives each F&B pair's stage a block wherever its partner holds an MoE block."""
    def ok(counts: Sequence[int]) -> bool:
        work = costs.stage_work(counts)
        return all(not (work[a][1] and not work[b][0]) and not (work[b][1] and not work[a][0]) for a, b in pairs)
    return ok


def count_layout(n_layers: int, mtp_depth: int, num_stages: int) -> list[int]:
    """Blocks per stage by counting: ``n_layers + mtp_depth`` units (an MTP module costs about one block)
    spread evenly, the extra units on later stages, the MTP units taken off the last stage (blocks only,
    evenly, when the last stage has fewer units than MTP modules)."""
    base, extra = divmod(n_layers + mtp_depth, num_stages)
    counts = [base + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]
    counts[-1] -= mtp_depth
    if counts[-1] < 0:
        base, extra = divmod(n_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    return counts


def stage_weights(placement: Placement, num_microbatches_per_chain: Sequence[int] | None = None
                  ) -> list[dict[int, float]]:
    """Per rank: {stage: share of the step's micro-batches it runs there} (chains split them evenly
    unless told otherwise)."""
    chains = len(placement)
    shares = [1.0 / chains] * chains if num_microbatches_per_chain is None else \
        [n / sum(num_microbatches_per_chain) for n in num_microbatches_per_chain]
    num_ranks = 1 + max(r for chain in placement for r in chain)
    out: list[dict[int, float]] = [{} for _ in range(num_ranks)]
    for c, chain in enumerate(placement):
        for s, r in enumerate(chain):
            out[r][s] = out[r].get(s, 0.0) + shares[c]
    return out


@dataclass(frozen=True)
class LayoutCost:
    """A layout and what it costs under the model (fractions of the whole model's cost)."""

    counts: tuple[int, ...]
    stages: tuple[float, ...]
    ranks: tuple[float, ...]

    @property
    def spread(self) -> float:
        """Heaviest over lightest rank (1.0: perfectly balanced)."""
        low = min(self.ranks)
        return max(self.ranks) / low if low > 0 else float("inf")

    def lead(self) -> tuple[float, float]:
        """The first two entries of ``key``: the heaviest rank and the heaviest stage (rounded)."""
        return round(max(self.ranks), 9), round(max(self.stages), 9)

    def key(self) -> tuple:
        """What the search minimises: the heaviest rank, the heaviest stage, then all rank and stage loads
        from the heaviest down (rounded, so float noise does not decide)."""
        ranks = tuple(round(x, 9) for x in sorted(self.ranks, reverse=True))
        stages = tuple(round(x, 9) for x in sorted(self.stages, reverse=True))
        return ranks[0], stages[0], ranks, stages


def layout_cost(costs: PieceCosts, counts: Sequence[int], weights: Sequence[dict[int, float]]) -> LayoutCost:
    """Stage and rank loads of ``counts`` blocks per stage, as fractions of the model's total cost."""
    total, pre = costs.total, costs.prefix
    bounds = list(accumulate(counts, initial=0))
    stages = [pre[hi] - pre[lo] for lo, hi in zip(bounds, bounds[1:])]
    stages[0] += costs.embedding
    stages[-1] += costs.tail
    stages = [c / total for c in stages]
    ranks = tuple(sum(stages[s] * share for s, share in w.items()) for w in weights)
    return LayoutCost(tuple(counts), tuple(stages), ranks)


def _compositions(n: int, parts: int, least: int = 0) -> Iterator[tuple[int, ...]]:
    """Every way to put ``n`` blocks on ``parts`` stages, at least ``least`` on each."""
    if parts == 1:
        if n >= least:
            yield (n,)
        return
    for first in range(least, n - least * (parts - 1) + 1):
        for rest in _compositions(n - first, parts - 1, least):
            yield (first, *rest)


def _even(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def _improve(costs: PieceCosts, counts: Sequence[int], weights: Sequence[dict[int, float]], least: int = 0,
             keep: Callable[[Sequence[int]], bool] | None = None) -> LayoutCost:
    """Take one block from a stage and give one to another (the blocks between shift by one) while the
    sorted loads get lighter; moving across several boundaries at once crosses the plateaus that
    one-boundary moves stop on. ``keep``: only moves to layouts it accepts (when the start is one)."""
    best = layout_cost(costs, counts, weights)
    if keep is not None and not keep(counts):
        keep = None
    S = len(counts)
    while True:
        moves = []
        for src in range(S):
            if best.counts[src] <= least:
                continue
            for dst in range(S):
                if dst != src:
                    c = list(best.counts)
                    c[src] -= 1
                    c[dst] += 1
                    if keep is None or keep(c):
                        moves.append(layout_cost(costs, c, weights))
        if not moves:
            return best
        lead = min(m.lead() for m in moves)  # the full key only where the heaviest rank and stage tie
        better = min((m for m in moves if m.lead() == lead), key=LayoutCost.key)
        if better.key() >= best.key():
            return best
        best = better


def balance(model: ModelSpec, placement: Placement, seq_len: int,
            num_microbatches_per_chain: Sequence[int] | None = None, min_blocks: int = 0,
            fb_units: bool = False) -> LayoutCost:
    """Blocks per stage for ``placement`` (``schedule.placement``: the rank of each chain's stages) that
    minimise the heaviest rank's modelled cost, then the heaviest stage's (module docstring), with the
    modelled stage and rank loads. ``min_blocks``: at least that many blocks on every stage (LLaVA keeps a
    text layer on each stage when it has enough; DeepSeek-V3 lets a stage hold only the embedding or the head).
    ``fb_units``: the schedule pairs each rank's two stages in F&B units (``ScheduleInfo.fb_units``); a stage
    whose partner holds MoE blocks then holds a block itself, where a layout allows it (module docstring)."""
    if not placement or len({len(c) for c in placement}) != 1:
        raise ValueError(f"placement must list chains of equal length, got {placement!r}")
    if min_blocks * len(placement[0]) > len(model.items(seq_len)) - 2:
        raise ValueError(f"{len(placement[0])} stages of at least {min_blocks} block(s) need more than the model's "
                         f"{len(model.items(seq_len)) - 2}")
    shares = None if num_microbatches_per_chain is None else tuple(num_microbatches_per_chain)
    return _balance(piece_costs(model, seq_len), model.mtp_depth, tuple(tuple(c) for c in placement), shares,
                    min_blocks, fb_units)


@lru_cache(maxsize=256)
def _balance(costs: PieceCosts, mtp_depth: int, placement: tuple[tuple[int, ...], ...],
             shares: tuple[int, ...] | None, least: int = 0, fb_units: bool = False) -> LayoutCost:
    """``balance`` on hashable arguments, cached: the planner asks for the same cut once per strategy."""
    S, n_layers = len(placement[0]), len(costs.blocks)
    weights = stage_weights(placement, shares)
    pairs = unit_pairs(placement) if fb_units else ()
    keep = _overlappable(costs, pairs) if pairs and (any(costs.moe_blocks) or costs.moe_tail) else None
    if comb(n_layers - least * S + S - 1, S - 1) <= EXHAUSTIVE_LIMIT:
        layouts = [layout_cost(costs, c, weights) for c in _compositions(n_layers, S, least)]
        best = min(layouts, key=LayoutCost.key)
        kept = [lc for lc in layouts if keep(lc.counts)] if keep is not None else []
    else:
        starts = [_even(n_layers, S)]
        if least == 0:
            starts.append(count_layout(n_layers, mtp_depth, S))  # the block-count layout is a start
        best = min((_improve(costs, c, weights, least) for c in starts), key=LayoutCost.key)
        kept = [f for f in (_improve(costs, c, weights, least, keep) for c in starts) if keep(f.counts)] \
            if keep is not None else []
    if kept:
        paired = min(kept, key=LayoutCost.key)
        if len(empty_stages(paired.counts)) <= len(empty_stages(best.counts)):  # the rule never empties a stage
            return paired
    return best


def empty_stages(counts: Sequence[int], first: bool = False) -> list[int]:
    """The stages before the last that hold no block (``counts``: blocks per stage); the first one only
    with ``first`` (it holds the embedding: empty only where a recompute policy needs a block there)."""
    return [s for s in range(0 if first else 1, len(counts) - 1) if counts[s] == 0]


def balanced_counts(model: ModelSpec, placement: Placement, seq_len: int, fb_units: bool = False) -> list[int]:
    """``balance``'s blocks per stage (what ``stages_for_rank`` builds by default at this ``seq_len``)."""
    return list(balance(model, placement, seq_len, fb_units=fb_units).counts)
