"""The shared model layer: the pieces model families compose (one small module per job).

==================  ======================================================================
``common``          ``compute_dtype``, ``deferred_init``, ``init_normal``, the ``SavesPerToken`` declaration
``norm``            ``RMSNorm``
``rope``            ``RopeSpec`` (plain, Llama-3, YaRN), ``cos_sin``, ``apply_rope``
``attention``       ``GQAttention`` (grouped-query, optional per-head q/k RMSNorm)
``mlp``             ``SwiGLUMLP`` (dense FFN and one expert)
``router``          ``Routing``, ``Router``, ``SoftmaxTopKRouter``
``moe``             ``LocalDispatch`` (dispatch/combine), ``Experts``, ``MoEBlock``
``expert_parallel`` ``EPDispatch`` (dispatch/combine by all-to-all over an EP group), ``local_expert_ids``
``head``            embedding, LM head, ``lm_loss``, ``count_targets``, ``step_normalizer``
==================  ======================================================================

Each module that keeps activations declares its recompute regions (``recompute_regions(policy)``, read
by ``integrations.recompute.apply_recompute``) and what it keeps per token (``saved_per_token``).
"""

from .attention import GQAttention
from .common import SavesPerToken, compute_dtype, deferred_init, init_normal, saved_elements_per_token
from .expert_parallel import EPDispatch, local_expert_ids
from .head import count_targets, embedding, lm_head, lm_loss, logits, step_normalizer
from .mlp import SwiGLUMLP
from .moe import DispatchPlan, Experts, LocalDispatch, MoEBlock
from .norm import RMSNorm
from .rope import RopeSpec, apply_rope, cos_sin, inv_freq
from .router import Router, Routing, SoftmaxTopKRouter

__all__ = [
    "DispatchPlan", "EPDispatch", "Experts", "GQAttention", "LocalDispatch", "MoEBlock", "RMSNorm", "RopeSpec",
    "Router", "Routing", "SavesPerToken", "SoftmaxTopKRouter", "SwiGLUMLP", "apply_rope", "compute_dtype", "cos_sin",
    "count_targets", "deferred_init", "embedding", "init_normal", "inv_freq", "lm_head", "lm_loss", "local_expert_ids",
    "logits", "saved_elements_per_token", "step_normalizer",
]
