"""The planner's model description of a Qwen3-MoE config (``planner.model.ModelSpec``).

The planner counts parameters, FLOPs and saved bytes per layer from SimuMax-style fields; Qwen3-MoE is
GQA attention plus softmax-routed experts without shared experts. Its per-head q/k RMSNorm weights
(2 · head_dim per layer) are left out of the planner's count, as are the router's softmax and top-k.
What a layer keeps for backward is not re-described here: ``declared_saved`` reads the modules'
``saved_per_token`` declarations, the same ones the recompute policies are built from.
The planner knows dense layers only as the first ``dense_layers``; a config whose dense layers sit
elsewhere (``mlp_only_layers`` in the middle, ``decoder_sparse_step`` > 1) is refused.
"""

from __future__ import annotations

import functools

import torch

from ...layers import saved_elements_per_token
from ...planner.model import ModelSpec
from .config import Qwen3MoeConfig


def declared_saved(config: Qwen3MoeConfig):
    """(kind, policy, seq) -> saved elements per token of one decoder layer, read from its modules'
    declarations (built once per kind on the meta device: no memory, any size)."""
    from .model import Qwen3MoeDecoderLayer  # lazy: the model's modules only when the planner asks

    dense = next((i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)), None)
    moe = next((i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)), None)

    @functools.cache
    def layer(kind: str) -> torch.nn.Module:
        index = moe if kind == "moe" else dense
        if index is None:
            raise ValueError(f"the config has no {kind} layer")
        with torch.device("meta"):
            return Qwen3MoeDecoderLayer(config, index)

    def per_token(kind: str, policy: str, seq: int, t: object = None) -> float:
        kept_input = config.hidden_size if policy == "full" else 0  # a fully recomputed layer keeps its input
        return float(saved_elements_per_token(layer(kind), policy, seq) + kept_input)

    return per_token


def planner_spec(config: Qwen3MoeConfig) -> ModelSpec:
    dense = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
    if dense != list(range(len(dense))):
        raise ValueError(f"the planner models dense layers as the first ones; this config's dense layers are {dense}")
    return ModelSpec(name="qwen3_moe", hidden_size=config.hidden_size, head_num=config.num_attention_heads,
                     layer_num=config.num_hidden_layers, vocab_size=config.vocab_size,
                     intermediate_size=config.intermediate_size, dense_layers=len(dense),
                     expert_num=config.num_experts, topk=config.num_experts_per_tok,
                     moe_ffn_hidden_size=config.moe_intermediate_size, attention_type="gqa",
                     kv_head_num=config.num_key_value_heads, head_size=config.head_dim,
                     declared_saved=declared_saved(config))
