"""The shared model layer: the pieces model families compose (one small module per job).

==================  ======================================================================
``common``          ``compute_dtype``, ``deferred_init``, ``init_normal``, the ``SavesPerToken`` declaration
``norm``            ``RMSNorm`` (optionally recomputed in B), ``rms_norm``
``rope``            ``RopeSpec`` (plain, Llama-3, YaRN), ``cos_sin``, ``apply_rope``
``attention``       ``GQAttention`` (grouped-query, optional per-head q/k RMSNorm)
``mla``             ``MLAttention`` (DeepSeek's multi-head latent attention)
``attention_core``  ``core_attention``: causal softmax attention, eager / recomputed / flash footprint
``flash_core``      ``flash_core``: the flash-style core (q, k, v, output and log-sum-exp kept)
``documents``       packed documents told apart by position ids: ``document_ids``, ``check_position_ids``,
                    ``check_document_labels``, ``hand_on`` (the stage contract), ``criterion_inputs``
``mlp``             ``SwiGLUMLP`` (dense FFN and one expert)
``router``          ``Routing``, ``Router``, ``SoftmaxTopKRouter``, ``GroupLimitedRouter`` (DeepSeek's),
                    ``group_limited_topk``
``balance``         expert balancing: ``AuxLoss`` (a loss injected in a layer's backward), the Switch,
                    sequence- and batch-wise losses, bias update, device-limited routing, capacity
``moe``             ``Dispatcher`` (dispatch/combine, local or over an EP group), ``Experts``, ``MoEBlock``
                    (every family's MoE: shared experts, balance losses, capacity, FP8 dispatch, savers)
``moe_state``       what a training loop sets or reads on every MoE layer: ``moe_layers``, ``set_timeout``,
                    ``set_ep_group``, ``set_aux_loss_scale``, ``mark_expert_weights``, ``update_expert_bias``,
                    ``dropped_fraction``, ``max_violation``
``expert_parallel`` the one expert dispatcher: the plan, bounded and overlappable all-to-alls (forward and
                    backward), FP8 rows, ``local_expert_ids``, the mesh's EP group
``head``            embedding, LM head, ``lm_loss``, ``count_targets``, ``step_normalizer``
==================  ======================================================================

Each module that keeps activations declares its recompute regions (``recompute_regions(policy)``, read
by ``models.recompute.apply_recompute``) and what it keeps per token (``saved_per_token``).
"""

from .attention import GQAttention
from .attention_core import core_attention
from .common import SavesPerToken, compute_dtype, deferred_init, init_normal, saved_elements_per_token
from .documents import check_document_labels, check_position_ids, criterion_inputs, document_ids, hand_on
from .expert_parallel import DispatchPlan, all_to_all, local_expert_ids, plan_dispatch
from .head import count_targets, embedding, lm_head, lm_loss, logits, step_normalizer
from .mla import MLAttention
from .mlp import SwiGLUMLP
from .moe import Dispatcher, Experts, MoEBlock
from .moe_state import (
    dropped_fraction,
    mark_expert_weights,
    max_violation,
    moe_layers,
    set_aux_loss_scale,
    set_ep_group,
    set_timeout,
    update_expert_bias,
)
from .norm import RMSNorm, rms_norm
from .rope import RopeSpec, apply_rope, cos_sin, inv_freq
from .router import GroupLimitedRouter, Router, Routing, SoftmaxTopKRouter

__all__ = [
    "DispatchPlan", "Dispatcher", "Experts", "GQAttention", "GroupLimitedRouter", "MLAttention", "MoEBlock",
    "RMSNorm", "RopeSpec", "Router", "Routing", "SavesPerToken", "SoftmaxTopKRouter", "SwiGLUMLP",
    "all_to_all", "apply_rope", "check_document_labels", "check_position_ids", "compute_dtype", "core_attention",
    "cos_sin", "count_targets", "criterion_inputs", "deferred_init", "document_ids", "dropped_fraction",
    "embedding", "hand_on", "init_normal", "inv_freq", "lm_head", "lm_loss", "local_expert_ids", "logits",
    "mark_expert_weights", "max_violation", "moe_layers", "plan_dispatch", "rms_norm", "saved_elements_per_token",
    "set_aux_loss_scale", "set_ep_group", "set_timeout", "step_normalizer", "update_expert_bias",
]
