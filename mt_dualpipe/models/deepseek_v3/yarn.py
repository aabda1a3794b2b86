"""YaRN rope scaling, the one config piece the Hugging Face conversion builds.

Its own module, below both ``config.py`` and ``hf_config.py``: ``config.py`` calls the conversion in
``hf_config.py``, which reads a checkpoint's ``rope_scaling`` into a ``YarnScaling``; with the class
here neither of the two needs the other in both directions. ``config.YarnScaling`` still names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (Peng et al. 2023) as the released DeepSeek-V3 config and transformers define it.

    ``factor`` stretches the context from ``original_max_position_embeddings``; frequencies whose
    wavelength fits fewer than ``beta_slow`` rotations are interpolated, more than ``beta_fast``
    extrapolated, a linear ramp in between. ``attention_factor`` scales cos/sin (None: derived from
    ``mscale`` / ``mscale_all_dim``); a non-zero ``mscale_all_dim`` also multiplies the softmax
    scale by ``(0.1·mscale_all_dim·ln(factor) + 1)²``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor >= 1:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError("rope_scaling.original_max_position_embeddings must be >= 1, got "
                             f"{self.original_max_position_embeddings}")

    @staticmethod
    def mscale_of(factor: float, mscale: float = 1.0) -> float:
        """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1 (1 when not stretched)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    def cos_sin_factor(self) -> float:
        """The factor transformers applies to cos and sin (its ``attention_factor``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.mscale_of(self.factor, self.mscale) / self.mscale_of(self.factor, self.mscale_all_dim)
        return self.mscale_of(self.factor)

    def softmax_factor(self) -> float:
        """What multiplies the attention softmax scale: mscale(factor, mscale_all_dim)² when set."""
        return self.mscale_of(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0
