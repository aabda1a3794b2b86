"""The default stage layout: blocks per stage chosen by a modelled cost, per rank first.

Counting blocks is not enough: the first stage also runs the embedding and the last one the final
norm, the output head, the MTP modules and the losses — at the tiny preset the last stage's extras
cost about two MoE blocks. V schedules (ZB-V, DualPipeV) make it worse, since rank 0 holds both the
first and the last stage. So every piece gets a modelled cost — the planner's per-token forward
FLOPs (``mt_dualpipe.planner.model``: GEMMs and core attention) plus the element-wise work the
FLOPs leave out (the embedding gather / scatter-add and the softmax cross-entropy over the
vocabulary) — and the layout minimises, in this order, the heaviest rank (a rank's load is the sum
of its stages, each weighted by the share of micro-batches its chain carries), the heaviest stage,
then the rest of the sorted loads. Small problems are searched exhaustively; large ones (671B over
16 ranks) by moving one block across a stage boundary at a time while that improves the loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import comb

from ...planner.model import ModelSpec
from .config import DeepSeekV3Config
from .layout import parse_layout

EXHAUSTIVE_LIMIT = 20000  # layouts; above this the boundary-move search runs
LOSS_FLOPS_PER_CLASS = 5.0  # softmax cross-entropy per vocabulary entry: max, sub, exp, sum, log-sum
EMBED_FLOPS_PER_DIM = 2.0   # gather forward, scatter-add backward


@dataclass(frozen=True)
class PieceCosts:
    """Modelled forward cost per token (FLOP-equivalents) of the pieces a stage may hold."""

    embedding: float
    blocks: tuple[float, ...]
    tail: float  # final norm, output head, MTP modules (their own embedding lookup included) and every loss

    def stage(self, index: int, num_stages: int, block_ids: Sequence[int]) -> float:
        cost = sum(self.blocks[i] for i in block_ids)
        cost += self.embedding if index == 0 else 0.0
        cost += self.tail if index == num_stages - 1 else 0.0
        return cost

    @property
    def total(self) -> float:
        return self.embedding + sum(self.blocks) + self.tail


def piece_costs(config: DeepSeekV3Config, seq_len: int | None = None) -> PieceCosts:
    """The modelled cost of the embedding, each block and the tail (head + MTP + losses) at ``seq_len``
    (default ``config.max_seq_len``)."""
    spec = ModelSpec.from_deepseek_config(config)
    items = spec.items(seq_len or config.max_seq_len)
    flops = [i.mm_flops + i.attn_flops for i in items]
    embed = EMBED_FLOPS_PER_DIM * config.dim
    losses = (1 + config.mtp_depth) * LOSS_FLOPS_PER_CLASS * config.vocab_size
    tail = flops[-1] + losses + (embed if config.mtp_depth else 0.0)
    return PieceCosts(flops[0] + embed, tuple(flops[1:-1]), tail)


def stage_weights(placement: Sequence[Sequence[int]], num_microbatches_per_chain: Sequence[int] | None = None
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

    def key(self) -> tuple:
        """What the search minimises: the heaviest rank, the heaviest stage, then all rank and stage loads
        from the heaviest down (rounded, so float noise does not decide)."""
        ranks = tuple(round(x, 9) for x in sorted(self.ranks, reverse=True))
        stages = tuple(round(x, 9) for x in sorted(self.stages, reverse=True))
        return ranks[0], stages[0], ranks, stages


def layout_cost(costs: PieceCosts, counts: Sequence[int], weights: Sequence[dict[int, float]]) -> LayoutCost:
    """Stage and rank loads of ``counts`` blocks per stage, as fractions of the model's total cost."""
    S, total = len(counts), costs.total
    start, stages = 0, []
    for i, n in enumerate(counts):
        stages.append(costs.stage(i, S, range(start, start + n)) / total)
        start += n
    ranks = tuple(sum(stages[s] * share for s, share in w.items()) for w in weights)
    return LayoutCost(tuple(counts), tuple(stages), ranks)


def _compositions(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, parts - 1):
            yield (first, *rest)


def _even(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def _improve(costs: PieceCosts, counts: Sequence[int], weights: Sequence[dict[int, float]]) -> LayoutCost:
    """Take one block from a stage and give one to another (the blocks between shift by one) while the
    sorted loads get lighter; moving across several boundaries at once crosses the plateaus that
    one-boundary moves stop on."""
    best = layout_cost(costs, counts, weights)
    S = len(counts)
    while True:
        moves = []
        for src in range(S):
            if not best.counts[src]:
                continue
            for dst in range(S):
                if dst != src:
                    c = list(best.counts)
                    c[src] -= 1
                    c[dst] += 1
                    moves.append(layout_cost(costs, c, weights))
        better = min(moves, key=LayoutCost.key, default=best)
        if better.key() >= best.key():
            return best
        best = better


def balanced_layout(config: DeepSeekV3Config, placement: Sequence[Sequence[int]], seq_len: int | None = None,
                    num_microbatches_per_chain: Sequence[int] | None = None) -> list[int]:
    """Blocks per stage for ``placement`` (``schedule.placement``: the rank of each chain's stages) that
    minimise the heaviest rank's modelled cost, then the heaviest stage's (see the module docstring)."""
    return list(balance(config, placement, seq_len, num_microbatches_per_chain).counts)


def balance(config: DeepSeekV3Config, placement: Sequence[Sequence[int]], seq_len: int | None = None,
            num_microbatches_per_chain: Sequence[int] | None = None) -> LayoutCost:
    """``balanced_layout`` with its modelled stage and rank loads."""
    if not placement or len({len(c) for c in placement}) != 1:
        raise ValueError(f"placement must list chains of equal length, got {placement!r}")
    S = len(placement[0])
    costs = piece_costs(config, seq_len)
    weights = stage_weights(placement, num_microbatches_per_chain)
    if comb(config.n_layers + S - 1, S - 1) <= EXHAUSTIVE_LIMIT:
        return min((layout_cost(costs, c, weights) for c in _compositions(config.n_layers, S)), key=LayoutCost.key)
    starts = (_even(config.n_layers, S), parse_layout(config, S))  # the block-count layout is a start
    return min((_improve(costs, c, weights) for c in starts), key=LayoutCost.key)
