"""DeepSeek-V3's attention: the shared layer's MLA (``layers/mla.py``) built from a ``DeepSeekV3Config``.

The sizes, the rotary embedding (``config.rope_spec``: YaRN at 671B), the softmax scale (times YaRN's
mscale²) and the memory savers come from the config: ``"norm"`` recomputes the latents' RMSNorms,
``"attention"`` keeps only q, k and v of the core (``core_attention="flash"`` keeps q, k, v, the output and
a log-sum-exp instead), ``"mla_input"`` shares one FP8 copy of the input between the two
down-projections. ``RMSNorm`` is the shared layer's in its ``fused`` form (one ``F.rms_norm`` in the
input dtype, as DeepSeek's reference implementation; the savers' byte counts and the planner assume what
that call keeps); ``compute_dtype`` is the shared layer's.
"""

from __future__ import annotations

from ...layers.common import compute_dtype
from ...layers.mla import MLAttention
from ...layers.norm import RMSNorm as _RMSNorm
from .config import DeepSeekV3Config

__all__ = ["MLA", "RMSNorm", "compute_dtype"]


class RMSNorm(_RMSNorm):
    """The shared ``RMSNorm``, fused (DeepSeek's reference form); ``recompute``: the ``"norm"`` saver."""

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = False) -> None:
        super().__init__(dim, eps, recompute, fused=True)


class MLA(MLAttention):
    def __init__(self, config: DeepSeekV3Config) -> None:
        c = config
        core = "flash" if c.core_attention == "flash" else ("recomputed" if c.saves("attention") else "eager")
        super().__init__(c.dim, c.n_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                         qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                         v_head_dim=c.v_head_dim, rope=c.rope_spec, softmax_scale=c.softmax_scale, eps=c.norm_eps,
                         rope_interleave=c.rope_interleave, norm_recompute=c.saves("norm"), fused_norm=True, core=core,
                         share_fp8_input=c.saves("mla_input"))
