"""DeepSeek-V3 config <-> Hugging Face ``config.json`` (the released checkpoint's format).

Three kinds of HF fields: those that map to a ``DeepSeekV3Config`` field (``_FIELD_MAP``); those
that must hold one value for this implementation to compute the same function (``_REQUIRED``:
SiLU, no attention bias, no GQA, untied embeddings, every layer after the dense ones MoE); and
metadata that does not shape the model (``_METADATA``: token ids, dtype, ``quantization_config``
(read by the checkpoint loader), ...), which is kept in ``hf_extra`` and written back by ``to_hf``.
Anything else is an error naming the field, so a checkpoint the model would silently misread is
refused at load time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...layers.rope import supported_scaling
from ..hf_checkpoint import check_fp8_quantization
from .yarn import YarnScaling

if TYPE_CHECKING:  # config.py imports this module: the config class is a type hint here only
    from .config import DeepSeekV3Config

# our field -> HF key (both directions)
_FIELD_MAP: dict[str, str] = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers",
    "n_dense_layers": "first_k_dense_replace",
    "n_heads": "num_attention_heads", "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok", "n_expert_groups": "n_group", "n_limited_groups": "topk_group",
    "route_scale": "routed_scaling_factor", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "mtp_depth": "num_nextn_predict_layers", "pad_token_id": "pad_token_id",
    "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps", "init_std": "initializer_range", "balance_loss_weight": "aux_loss_alpha",
    "scoring_func": "scoring_func", "topk_method": "topk_method", "norm_topk_prob": "norm_topk_prob",
    "rope_interleave": "rope_interleave",
}
# HF key -> the only value we run (None means "absent or null is fine too")
_REQUIRED: dict[str, Any] = {
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "moe_layer_freq": 1,
    "model_type": "deepseek_v3", "attention_dropout": 0.0, "pretraining_tp": 1,
}
_METADATA = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "use_cache", "ep_size", "seq_aux", "quantization_config", "output_router_logits", "_name_or_path",
    "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "head_dim", "qk_head_dim", "num_key_value_heads",
    "rope_scaling", "rope_parameters",
})
_STORAGE = ("quantization_config", "torch_dtype", "dtype")
_YARN_KEYS = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate"}


def read_config_json(source: str | Path) -> dict[str, Any]:
    """The dict in ``source`` (a ``config.json`` or a folder holding one); a clear error otherwise."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path} (expected a config.json or a folder holding one)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _rope(data: dict[str, Any]) -> tuple[float | None, YarnScaling | None]:
    """(rope_theta, YarnScaling | None) from ``rope_scaling`` (released) or ``rope_parameters`` (transformers 5)."""
    theta, params = supported_scaling(data, "DeepSeek-V3", "yarn", _YARN_KEYS)
    if params is None:
        return theta, None
    if params.get("factor") is None:  # transformers: the ratio of the context lengths
        params["factor"] = data["max_position_embeddings"] / params["original_max_position_embeddings"]
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        params[key] = float(params.get(key) or default)
    return theta, YarnScaling(**params)


def _check_required(data: dict[str, Any]) -> None:
    for key, want in _REQUIRED.items():
        if key in data and data[key] is not None and data[key] != want:
            raise ValueError(f"config field {key}={data[key]!r} is not supported: this DeepSeek-V3 implementation "
                             f"runs {key}={want!r} only")
    kv = data.get("num_key_value_heads")
    if kv is not None and kv != data.get("num_attention_heads"):
        raise ValueError(f"config field num_key_value_heads={kv} is not supported: MLA has one key/value per head "
                         f"(num_key_value_heads must equal num_attention_heads={data.get('num_attention_heads')})")
    quant = data.get("quantization_config")
    if quant is not None:
        check_fp8_quantization(quant)


def config_kwargs_from_hf(data: dict[str, Any]) -> dict[str, Any]:
    """``DeepSeekV3Config`` keyword arguments for an HF config dict (errors name the bad field)."""
    known = set(_FIELD_MAP.values()) | set(_REQUIRED) | _METADATA
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"config field(s) {unknown} are not supported by the DeepSeek-V3 integration "
                         f"(known: {sorted(known)})")
    _check_required(data)
    theta, yarn = _rope(data)
    kwargs: dict[str, Any] = {}
    for ours, theirs in _FIELD_MAP.items():
        if theirs in data and data[theirs] is not None:
            kwargs[ours] = data[theirs]
    if theta is not None:
        kwargs["rope_theta"] = float(theta)
    if "q_lora_rank" in data and data["q_lora_rank"] is None:
        kwargs["q_lora_rank"] = 0
    if data.get("n_group") is None and "n_group" in data:  # V2-lite style: no groups
        kwargs["n_expert_groups"] = kwargs["n_limited_groups"] = 1
    kwargs["rope_scaling"] = yarn
    extra = {k: v for k, v in data.items() if k in _METADATA and k not in ("rope_scaling", "rope_parameters",
                                                                          "head_dim", "qk_head_dim",
                                                                          "num_key_value_heads")}
    extra.update({k: v for k, v in data.items() if k in _REQUIRED})
    kwargs["hf_extra"] = tuple(sorted((k, json.dumps(v)) for k, v in extra.items()))
    return kwargs


def _yarn_to_hf(yarn: YarnScaling) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "yarn", "factor": yarn.factor,
                           "original_max_position_embeddings": yarn.original_max_position_embeddings,
                           "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(yarn, key) is not None:
            out[key] = getattr(yarn, key)
    if not yarn.truncate:
        out["truncate"] = False
    return out


def config_to_hf(config: DeepSeekV3Config) -> dict[str, Any]:
    """The HF dict: released-style keys (``rope_theta`` + ``rope_scaling``), which transformers 4 and 5 read.
    Storage fields (``quantization_config``, ``torch_dtype``) are left to whoever writes the weights."""
    out: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    out.update({k: v for k, v in _REQUIRED.items() if k != "model_type"})
    # the storage format (quantization_config, torch_dtype) belongs to a checkpoint, set by its writer
    out.update({k: json.loads(v) for k, v in config.hf_extra if k not in _STORAGE})
    for ours, theirs in _FIELD_MAP.items():
        out[theirs] = getattr(config, ours)
    out["q_lora_rank"] = config.q_lora_rank or None
    out["num_key_value_heads"] = config.n_heads
    out["rope_scaling"] = _yarn_to_hf(config.rope_scaling) if config.rope_scaling is not None else None
    return dict(sorted(out.items()))
