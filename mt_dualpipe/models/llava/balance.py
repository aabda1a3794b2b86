"""Text layers per stage chosen by modelled cost, the vision encoder counted on the first stage: the planner's
stage cut (``planner/stage_cut.py``, the one the DeepSeek-V3 runtime and the planner use), on LLaVA's model.

An even split of the text layers ignores that the first stage also runs the vision tower and the
projector for every image of every sample; with a heavy encoder (LLaVA-1.5's CLIP-L/336: 576
positions x 23 layers per image) the first stage is then the pipeline's slowest. LLaVA's planner model
(``spec.planner_spec``) folds the encoder into its embedding item, so the cut's modelled cost of the first
stage carries it; every stage keeps at least one text layer when there are enough.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...planner.stage_cut import balance
from .config import LlavaConfig
from .spec import planner_spec


def balanced_layout(config: LlavaConfig, placement: Sequence[Sequence[int]] | int, *, seq_len: int | None = None,
                    images_per_sample: float = 1.0) -> list[int]:
    """Text layers per stage for ``placement`` (``schedule.placement``: the rank of each chain's stages, or a
    number of stages, one rank each) minimising the heaviest rank's modelled cost, then the heaviest
    stage's (``planner.stage_cut.balance``) at ``seq_len`` tokens (default ``max_position_embeddings``)."""
    if isinstance(placement, int):
        placement = [list(range(placement))]
    stages = len(placement[0]) if placement else 0
    least = 1 if config.num_hidden_layers >= stages else 0
    seq = seq_len or config.text.max_position_embeddings
    return list(balance(planner_spec(config, images_per_sample), placement, seq, min_blocks=least).counts)
