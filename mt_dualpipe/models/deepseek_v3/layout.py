"""Blocks per pipeline stage: a layout given as counts or a Megatron-style string, or the block-count default.

Its own module, below ``stages.py`` (which builds the stages a layout describes; by default the
balanced layout of ``stage_balance.py``). The block-count layout is ``planner.stage_cut.count_layout``,
where the balancing search also starts from it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ...planner.stage_cut import count_layout
from .config import DeepSeekV3Config


def parse_layout(config: DeepSeekV3Config, num_stages: int, layout: Sequence[int] | str | None = None) -> list[int]:
    """Blocks per stage. ``layout`` is a list of counts, or a Megatron-style string such as
    ``"Et*2|t*2|t|tmL"`` (``|`` separates stages; ``E`` embedding, ``t`` a block, ``t*N`` N blocks,
    ``m`` MTP, ``L`` loss — ``E`` only in the first stage, ``m``/``L`` only in the last).
    None balances ``n_layers + mtp_depth`` units (an MTP module costs about one block) with the
    extra units going to later stages, so the first stage also carries the embedding lightly."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if layout is None:
        return count_layout(config.n_layers, config.mtp_depth, num_stages)
    if isinstance(layout, str):
        parts = layout.split("|")
        if len(parts) != num_stages:
            raise ValueError(f"layout {layout!r} has {len(parts)} stage(s) but {num_stages} are needed")
        counts = []
        for i, part in enumerate(parts):
            n = 0
            for tok, rep in re.findall(r"([EtmL])(?:\*(\d+))?", part):
                if tok == "E" and i != 0:
                    raise ValueError(f"layout {layout!r}: 'E' (embedding) may only appear in the first stage")
                if tok in "mL" and i != num_stages - 1:
                    raise ValueError(f"layout {layout!r}: {tok!r} may only appear in the last stage")
                if tok == "t":
                    n += int(rep or 1)
            if re.sub(r"([EtmL])(\*\d+)?", "", part):
                raise ValueError(f"layout {layout!r}: stage {i} {part!r} has characters other than E, t, m, L, *N")
            counts.append(n)
        layout = counts
    counts = [int(c) for c in layout]
    if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != config.n_layers:
        raise ValueError(f"layout {list(layout)} must give {num_stages} non-negative block counts summing to "
                         f"n_layers = {config.n_layers}")
    return counts


def stage_layer_ids(config: DeepSeekV3Config, num_stages: int, layout: Sequence[int] | str | None = None
                    ) -> list[list[int]]:
    counts = parse_layout(config, num_stages, layout)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]
