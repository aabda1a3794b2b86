"""The planner's model description of a DeepSeek-V3 config (``planner.model.ModelSpec``).

Shapes and FLOPs come from the config (MLA, DeepSeekMoE with one shared expert, MTP); what a layer, the head and
an MTP depth keep for backward is not re-described here: ``declared_saved`` and ``declared_head`` read the
modules' ``saved_per_token`` declarations (``Block``, ``MTPModule``, the final norm, ``head_saved_per_token``),
built on the meta device in the plan's dtype, with FP8 linears when the plan trains in FP8, the flash core when
it counts one, and the config's ``memory_savers`` on.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...layers import saved_elements_per_token
from ...planner.model import ModelSpec
from .config import DeepSeekV3Config

_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _plan_config(config: DeepSeekV3Config, t: Any) -> tuple[DeepSeekV3Config, torch.dtype, bool]:
    """The config the plan's modules are built with (the flash core when ``t`` counts one), their dtype and
    whether their linears are FP8 (``t``: the planner's ``Dtypes``; None: the model dtype, eager)."""
    if t is None:
        return config, torch.bfloat16, False
    core = "flash" if t.fused_attention else "eager"
    return config.replace(core_attention=core), _DTYPES[int(t.elem)], bool(t.fp8)


@functools.cache
def _built(config: DeepSeekV3Config, what: str, dtype: torch.dtype, fp8: bool) -> torch.nn.Module:
    """One ``Block`` (``"dense"`` or ``"moe"``), ``MTPModule`` (``"mtp"``) or final norm (``"norm"``) on the meta
    device (no memory, any size)."""
    from ...fp8 import convert_to_fp8
    from .mla import RMSNorm
    from .model import Block, MTPModule

    with torch.device("meta"):
        if what == "norm":
            module: torch.nn.Module = RMSNorm(config.dim, config.norm_eps)  # the last stage's: no "norm" saver
        elif what == "mtp":
            module = MTPModule(1, config)
        else:
            index = next((i for i in range(config.n_layers) if config.is_moe_layer(i) == (what == "moe")), None)
            if index is None:
                raise ValueError(f"the config has no {what} layer")
            module = Block(index, config)
        module = module.to(dtype)
    if fp8 and what != "norm":
        convert_to_fp8(module, backend="emulated")
    return module


def declared_saved(config: DeepSeekV3Config):
    """(kind, policy, seq, dtypes) -> saved elements per token of one block, from its declaration."""
    def per_token(kind: str, policy: str, seq: int, t: Any = None) -> float:
        cfg, dtype, fp8 = _plan_config(config, t)
        return float(saved_elements_per_token(_built(cfg, kind, dtype, fp8), policy, seq))

    return per_token


def declared_head(config: DeepSeekV3Config):
    """(part, policy, seq, dtypes) -> saved elements per token of the head (``"head"``: final norm, head, loss) or of
    one MTP depth besides its block (``"mtp"``: its norms and projection, the embedded ids, the shared head and its
    loss), from the modules' declarations."""
    from .model import head_saved_per_token

    def per_token(part: str, policy: str, seq: int, t: Any = None) -> float:
        cfg, dtype, fp8 = _plan_config(config, t)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        head = sum(head_saved_per_token(cfg.dim, cfg.vocab_size, cfg.saves("loss"), itemsize).values())
        if part == "head":
            return float(saved_elements_per_token(_built(cfg, "norm", dtype, fp8), "none", seq) + head)
        mtp = _built(cfg, "mtp", dtype, fp8).saved_per_token("none", seq)
        own = sum(v for n, v in mtp.items() if not n.startswith("block."))
        return float(own + head + 8 / itemsize)  # + the embedded next-token ids

    return per_token


def planner_spec(config: DeepSeekV3Config) -> ModelSpec:
    c = config
    return ModelSpec(name="deepseek_v3", hidden_size=c.dim, head_num=c.n_heads, layer_num=c.n_layers,
                     vocab_size=c.vocab_size, intermediate_size=c.inter_dim, dense_layers=c.n_dense_layers,
                     expert_num=c.n_routed_experts, topk=c.n_activated_experts, moe_ffn_hidden_size=c.moe_inter_dim,
                     moe_shared_expert_intermediate_size=c.moe_inter_dim * c.n_shared_experts, attention_type="mla",
                     q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_head_dim=c.qk_nope_head_dim,
                     qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, mtp_depth=c.mtp_depth,
                     declared_saved=declared_saved(c), declared_head=declared_head(c))
