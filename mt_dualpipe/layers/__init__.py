"""The shared model layer: the pieces model families compose (one small module per job).

==================  ======================================================================
``common``          ``compute_dtype``, ``deferred_init``, ``init_normal``, the ``SavesPerToken`` declaration
``norm``            ``RMSNorm`` (optionally recomputed in B), ``rms_norm``
``rope``            ``RopeSpec`` (plain, Llama-3, YaRN), ``cos_sin``, ``apply_rope``
``attention``       ``GQAttention`` (grouped-query, optional per-head q/k RMSNorm)
``mla``             ``MLAttention`` (DeepSeek's multi-head latent attention)
``attention_core``  ``core_attention``: causal softmax attention, eager / recomputed / flash footprint
``flash_core``      ``flash_core``: the flash-style core (q, k, v, output and log-sum-exp kept)
``mlp``             ``SwiGLUMLP`` (dense FFN and one expert)
``router``          ``Routing``, ``Router``, ``SoftmaxTopKRouter``, ``SigmoidGroupLimitedRouter``,
                    ``group_limited_topk``
``balance``         ``AuxLoss`` (a loss injected in a layer's backward), ``switch_balance_loss``
``moe``             ``LocalDispatch`` (dispatch/combine), ``Experts``, ``MoEBlock``
``expert_parallel`` ``EPDispatch`` (dispatch/combine by all-to-all over an EP group), ``local_expert_ids``
``head``            embedding, LM head, ``lm_loss``, ``count_targets``, ``step_normalizer``
==================  ======================================================================

Each module that keeps activations declares its recompute regions (``recompute_regions(policy)``, read
by ``models.recompute.apply_recompute``) and what it keeps per token (``saved_per_token``).
"""

from .attention import GQAttention
from .attention_core import core_attention
from .common import SavesPerToken, compute_dtype, deferred_init, init_normal, saved_elements_per_token
from .expert_parallel import EPDispatch, local_expert_ids
from .head import count_targets, embedding, lm_head, lm_loss, logits, step_normalizer
from .mla import MLAttention
from .mlp import SwiGLUMLP
from .moe import DispatchPlan, Experts, LocalDispatch, MoEBlock
from .norm import RMSNorm, rms_norm
from .rope import RopeSpec, apply_rope, cos_sin, inv_freq
from .router import Router, Routing, SigmoidGroupLimitedRouter, SoftmaxTopKRouter

__all__ = [
    "DispatchPlan", "EPDispatch", "Experts", "GQAttention", "LocalDispatch", "MLAttention", "MoEBlock", "RMSNorm",
    "RopeSpec", "Router", "Routing", "SavesPerToken", "SigmoidGroupLimitedRouter", "SoftmaxTopKRouter", "SwiGLUMLP",
    "apply_rope", "compute_dtype", "core_attention", "cos_sin", "count_targets", "deferred_init", "embedding",
    "init_normal", "inv_freq", "lm_head", "lm_loss", "local_expert_ids", "logits", "rms_norm",
    "saved_elements_per_token", "step_normalizer",
]
