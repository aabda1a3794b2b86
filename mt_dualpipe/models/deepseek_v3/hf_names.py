"""Our DeepSeek-V3 parameter names <-> the released checkpoint's (Hugging Face) tensor names.

Module names here follow the reference inference code (``attn.wq_a``, ``ffn.gate_proj``, ...), the
checkpoint follows transformers (``self_attn.q_a_proj``, ``mlp.gate_proj``, ...). A block's names
map component by component; the MTP module k (0-based) is checkpoint layer ``num_hidden_layers + k``
holding ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the block's own tensors, and copies
of the shared ``embed_tokens`` and ``shared_head.head`` (written on save, not read on load: the MTP
module shares the main model's embedding and head). Stage parameter names equal the full model's,
so the same functions serve a model and any stage.
"""

from __future__ import annotations

import re

from .config import DeepSeekV3Config

_PARTS = {
    "attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj", "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
}
_PARTS_BACK = {v: k for k, v in _PARTS.items()}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_MTP = {"hnorm": "hnorm", "enorm": "enorm", "proj": "eh_proj", "norm": "shared_head.norm"}
_MTP_BACK = {v: k for k, v in _MTP.items()}


def _block_to_hf(suffix: str) -> str:
    return ".".join(_PARTS.get(p, p) for p in suffix.split("."))


def _block_from_hf(suffix: str) -> str:
    return ".".join(_PARTS_BACK.get(p, p) for p in suffix.split("."))


def to_hf_name(name: str, config: DeepSeekV3Config) -> str:
    """The checkpoint name of one of our state-dict keys (model or stage)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"model.layers.{m[1]}.{_block_to_hf(m[2])}"
    m = re.fullmatch(r"mtp\.(\d+)\.(block\.)?([^.]+)\.(.+)", name)
    if m:
        layer = config.n_layers + int(m[1])
        if m[2]:
            return f"model.layers.{layer}.{_block_to_hf(m[3] + '.' + m[4])}"
        if m[3] in _MTP:
            return f"model.layers.{layer}.{_MTP[m[3]]}.{m[4]}"
    raise KeyError(f"no checkpoint name for parameter {name!r}")


def from_hf_name(name: str, config: DeepSeekV3Config) -> str | None:
    """Our key for a checkpoint name; None for the MTP layers' copies of the shared embedding and head."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        raise KeyError(f"checkpoint tensor {name!r} is not a DeepSeek-V3 tensor name")
    layer, rest = int(m[1]), m[2]
    if layer < config.n_layers:
        return f"layers.{layer}.{_block_from_hf(rest)}"
    k = layer - config.n_layers
    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return None
    for hf, ours in _MTP_BACK.items():
        if rest.startswith(hf + "."):
            return f"mtp.{k}.{ours}.{rest[len(hf) + 1:]}"
    return f"mtp.{k}.block.{_block_from_hf(rest)}"


def shared_copies(name: str, config: DeepSeekV3Config) -> list[str]:
    """Extra checkpoint names a key is also saved under: the MTP layers' embedding and head copies."""
    layers = range(config.n_layers, config.n_layers + config.mtp_depth)
    if name == "embed.weight":
        return [f"model.layers.{i}.embed_tokens.weight" for i in layers]
    if name == "head.weight":
        return [f"model.layers.{i}.shared_head.head.weight" for i in layers]
    return []


def is_fp8_weight(hf_name: str) -> bool:
    """Weights the released checkpoint stores in FP8: the attention and FFN/expert projections
    (not the embedding, head, router, norms or the MTP ``eh_proj``)."""
    return bool(re.search(r"\.(self_attn|mlp)\.(.+\.)?[a-z_]+_proj(_with_mqa)?\.weight$", hf_name))


def is_fp32_weight(hf_name: str) -> bool:
    """Router tensors the released checkpoint keeps in float32 (transformers pins them too)."""
    return hf_name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))
