"""Text layers per stage chosen by modelled cost, the vision encoder counted on the first stage.

An even split of the text layers ignores that the first stage also runs the vision tower and the
projector for every image of every sample; with a heavy encoder (LLaVA-1.5's CLIP-L/336: 576
positions x 23 layers per image) the first stage is then the pipeline's slowest. Every piece gets
the planner's forward FLOPs per token (``spec.planner_spec``: GEMMs and core attention, the encoder
folded into the embedding item) plus the element-wise work the FLOPs leave out (the embedding
gather / scatter-add and the softmax cross-entropy over the vocabulary, the same constants as
DeepSeek-V3's balancer), and the layout minimises, in this order, the heaviest rank (a rank's load
is the sum of its stages, each weighted by the share of micro-batches its chain carries: V schedules
put the first and the last stage on one rank), the heaviest stage, then the other loads. Every
stage keeps at least one text layer when there are enough; small problems are searched
exhaustively, large ones by moving one layer across stage boundaries while that helps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from math import comb

from .config import LlavaConfig
from .spec import planner_spec

EXHAUSTIVE_LIMIT = 20000  # layouts; above this the boundary-move search runs
LOSS_FLOPS_PER_CLASS = 5.0  # softmax cross-entropy per vocabulary entry
EMBED_FLOPS_PER_DIM = 2.0  # gather forward, scatter-add backward


def piece_costs(config: LlavaConfig, seq_len: int | None = None, images_per_sample: float = 1.0
                ) -> tuple[float, list[float], float]:
    """Modelled forward cost per text token of (first-stage extras: embedding + vision encoder + projector,
    each text layer, last-stage extras: norm + head + loss) at ``seq_len`` (default
    ``max_position_embeddings``)."""
    seq = seq_len or config.text.max_position_embeddings
    items = planner_spec(config, images_per_sample).items(seq)
    flops = [i.mm_flops + i.attn_flops for i in items]
    first = flops[0] + EMBED_FLOPS_PER_DIM * config.text.hidden_size
    last = flops[-1] + LOSS_FLOPS_PER_CLASS * config.text.vocab_size
    return first, flops[1:-1], last


def _stage_weights(placement: Sequence[Sequence[int]]) -> list[dict[int, float]]:
    """Per rank: {stage: share of the step's micro-batches it runs there} (chains split them evenly)."""
    share = 1.0 / len(placement)
    out: list[dict[int, float]] = [{} for _ in range(1 + max(r for chain in placement for r in chain))]
    for chain in placement:
        for s, r in enumerate(chain):
            out[r][s] = out[r].get(s, 0.0) + share
    return out


def _key(counts: Sequence[int], costs: tuple[float, list[float], float], weights: list[dict[int, float]]) -> tuple:
    first, layers, last = costs
    stages, start = [], 0
    for s, n in enumerate(counts):
        load = sum(layers[start:start + n]) + (first if s == 0 else 0.0) + (last if s == len(counts) - 1 else 0.0)
        stages.append(load)
        start += n
    total = first + sum(layers) + last
    ranks = sorted((round(sum(stages[s] * w for s, w in rw.items()) / total, 9) for rw in weights), reverse=True)
    stage_loads = sorted((round(x / total, 9) for x in stages), reverse=True)
    return ranks[0], stage_loads[0], tuple(ranks), tuple(stage_loads)


def _compositions(n: int, parts: int, least: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if n >= least:
            yield (n,)
        return
    for first in range(least, n - least * (parts - 1) + 1):
        for rest in _compositions(n - first, parts - 1, least):
            yield (first, *rest)


def _improve(counts: list[int], least: int, score: Callable[[Sequence[int]], tuple]) -> list[int]:
    best, best_key = counts, score(counts)
    while True:
        moves = []
        for src in range(len(best)):
            for dst in range(len(best)):
                if src != dst and best[src] > least:
                    c = list(best)
                    c[src] -= 1
                    c[dst] += 1
                    moves.append((score(c), c))
        key, c = min(moves, default=(best_key, best))
        if key >= best_key:
            return best
        best, best_key = c, key


def balanced_layout(config: LlavaConfig, placement: Sequence[Sequence[int]] | int, *, seq_len: int | None = None,
                    images_per_sample: float = 1.0) -> list[int]:
    """Text layers per stage for ``placement`` (``schedule.placement``: the rank of each chain's stages, or a
    number of stages, one rank each) minimising the heaviest rank's modelled cost, then the heaviest
    stage's (module docstring)."""
    if isinstance(placement, int):
        placement = [list(range(placement))]
    if not placement or len({len(c) for c in placement}) != 1:
        raise ValueError(f"placement must list chains of equal length, got {placement!r}")
    S, n = len(placement[0]), config.num_hidden_layers
    least = 1 if n >= S else 0
    costs = piece_costs(config, seq_len, images_per_sample)
    weights = _stage_weights(placement)

    def score(counts: Sequence[int]) -> tuple:
        return _key(counts, costs, weights)

    if comb(n - least * S + S - 1, S - 1) <= EXHAUSTIVE_LIMIT:
        return list(min(_compositions(n, S, least), key=score))
    base, extra = divmod(n, S)
    return _improve([base + (1 if i >= S - extra else 0) for i in range(S)], least, score)
