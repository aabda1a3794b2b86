"""The planner's model description of a Qwen3-MoE config (``planner.model.ModelSpec``).

The planner counts parameters, FLOPs and saved bytes per layer from SimuMax-style fields; Qwen3-MoE is
GQA attention plus softmax-routed experts without shared experts. Its per-head q/k RMSNorm weights
(2 · head_dim per layer) are left out of the planner's count, as are the router's softmax and top-k.
The planner knows dense layers only as the first ``dense_layers``; a config whose dense layers sit
elsewhere (``mlp_only_layers`` in the middle, ``decoder_sparse_step`` > 1) is refused.
"""

from __future__ import annotations

from ...planner.model import ModelSpec
from .config import Qwen3MoeConfig


def planner_spec(config: Qwen3MoeConfig) -> ModelSpec:
    dense = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
    if dense != list(range(len(dense))):
        raise ValueError(f"the planner models dense layers as the first ones; this config's dense layers are {dense}")
    return ModelSpec(name="qwen3_moe", hidden_size=config.hidden_size, head_num=config.num_attention_heads,
                     layer_num=config.num_hidden_layers, vocab_size=config.vocab_size,
                     intermediate_size=config.intermediate_size, dense_layers=len(dense),
                     expert_num=config.num_experts, topk=config.num_experts_per_tok,
                     moe_ffn_hidden_size=config.moe_intermediate_size, attention_type="gqa",
                     kv_head_num=config.num_key_value_heads, head_size=config.head_dim)
