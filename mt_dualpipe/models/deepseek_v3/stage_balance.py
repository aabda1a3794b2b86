"""The default DeepSeek-V3 stage layout: blocks per stage balanced per rank by a modelled cost.

The search lives in the planner (``mt_dualpipe.planner.stage_cut``: why per rank, what the cost
counts, how large problems are searched), so the cut the planner estimates memory and time for is
the cut ``stages_for_rank`` builds. This module asks it for a ``DeepSeekV3Config`` (its
``ModelSpec``, at ``seq_len`` or the config's ``max_seq_len``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...planner.model import ModelSpec
from ...planner.stage_cut import LayoutCost, PieceCosts, layout_cost, stage_weights
from ...planner.stage_cut import balance as _balance
from ...planner.stage_cut import piece_costs as _piece_costs
from .config import DeepSeekV3Config

__all__ = ["LayoutCost", "PieceCosts", "balance", "balanced_layout", "layout_cost", "piece_costs", "stage_weights"]


def piece_costs(config: DeepSeekV3Config, seq_len: int | None = None) -> PieceCosts:
    """The modelled cost of the embedding, each block and the tail (head + MTP + losses) at ``seq_len``
    (default ``config.max_seq_len``)."""
    return _piece_costs(ModelSpec.from_deepseek_config(config), seq_len or config.max_seq_len)


def balanced_layout(config: DeepSeekV3Config, placement: Sequence[Sequence[int]], seq_len: int | None = None,
                    num_microbatches_per_chain: Sequence[int] | None = None, fb_units: bool = False) -> list[int]:
    """Blocks per stage for ``placement`` (``schedule.placement``: the rank of each chain's stages) that
    minimise the heaviest rank's modelled cost, then the heaviest stage's (``planner.stage_cut``); with
    ``fb_units`` (DualPipe, DualPipeV) among the layouts that leave no stage without a block beside an F&B
    partner holding MoE blocks."""
    return list(balance(config, placement, seq_len, num_microbatches_per_chain, fb_units).counts)


def balance(config: DeepSeekV3Config, placement: Sequence[Sequence[int]], seq_len: int | None = None,
            num_microbatches_per_chain: Sequence[int] | None = None, fb_units: bool = False) -> LayoutCost:
    """``balanced_layout`` with its modelled stage and rank loads."""
    return _balance(ModelSpec.from_deepseek_config(config), placement, seq_len or config.max_seq_len,
                    num_microbatches_per_chain, fb_units=fb_units)
