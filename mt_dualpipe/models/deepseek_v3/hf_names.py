"""Our DeepSeek-V3 parameter names <-> the released checkpoint's (Hugging Face) tensor names.

Modules carry the checkpoint's names (``model.embed_tokens``, ``model.layers.N.self_attn.q_a_proj``,
``mlp.experts.E.gate_proj``, ``model.norm``, ``lm_head``); only the MTP depths differ: depth k's module is
``mtp.{k-1}`` (the last stage's declared extra) with its block under ``block.``, the checkpoint's layer
``num_hidden_layers + k - 1`` holding ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the block's
tensors, and copies of the shared ``embed_tokens`` and ``shared_head.head`` (written on save, not read on
load: the MTP module shares the main model's embedding and head). Stage parameter names equal the full
model's, so the same functions serve a model and any stage.
"""

from __future__ import annotations

import re

from .config import DeepSeekV3Config


def to_hf_name(name: str, config: DeepSeekV3Config) -> str:
    """The checkpoint name of one of our state-dict keys (model or stage)."""
    m = re.fullmatch(r"mtp\.(\d+)\.(block\.)?(.+)", name)
    return f"model.layers.{config.n_layers + int(m[1])}.{m[3]}" if m else name


def from_hf_name(name: str, config: DeepSeekV3Config) -> str | None:
    """Our key for a checkpoint name; None for the MTP layers' copies of the shared embedding and head."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or int(m[1]) < config.n_layers:
        return name
    k, rest = int(m[1]) - config.n_layers, m[2]
    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return None
    own = rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.norm."))
    return f"mtp.{k}.{rest}" if own else f"mtp.{k}.block.{rest}"


def shared_copies(name: str, config: DeepSeekV3Config) -> list[str]:
    """Extra checkpoint names a key is also saved under: the MTP layers' embedding and head copies."""
    layers = range(config.n_layers, config.n_layers + config.mtp_depth)
    if name == "model.embed_tokens.weight":
        return [f"model.layers.{i}.embed_tokens.weight" for i in layers]
    if name == "lm_head.weight":
        return [f"model.layers.{i}.shared_head.head.weight" for i in layers]
    return []


def is_fp8_weight(hf_name: str) -> bool:
    """Weights the released checkpoint stores in FP8: the attention and FFN/expert projections
    (not the embedding, head, router, norms or the MTP ``eh_proj``)."""
    return bool(re.search(r"\.(self_attn|mlp)\.(.+\.)?[a-z_]+_proj(_with_mqa)?\.weight$", hf_name))


def is_fp32_weight(hf_name: str) -> bool:
    """Router tensors the released checkpoint keeps in float32 (transformers pins them too)."""
    return hf_name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))
