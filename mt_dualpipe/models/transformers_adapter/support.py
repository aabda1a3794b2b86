"""What the transformers adapter takes, decided from the config alone, before any weight is read.

The adapter runs a transformers decoder-only causal LM as pipeline stages made of its own modules:
``model.embed_tokens``, ``model.layers[i]``, ``model.norm`` and ``lm_head``. A stage calls the layers itself,
so it must be able to rebuild, from the hidden states it receives, everything transformers' ``XModel.forward``
hands each layer: the rotary position embeddings (per layer type where the model has several), the position ids
and the causal mask, full or sliding-window, per layer. That holds for the models transformers itself declares
pipeline-able as ``embed_tokens -> layers -> norm`` (their config's ``base_model_pp_plan``) whose layer types are
full or sliding-window attention. Anything else (encoder-decoders, multimodal wrappers, linear-attention,
chunked or indexed layers, bidirectional attention, quantized checkpoints, a balance loss over every layer's
router logits) is refused here with the reason and ``DOCS``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from ..registry import ADAPTER_DOCS as DOCS

ATTENTION_TYPES = ("full_attention", "sliding_attention")
PIPELINE_PARTS = ("embed_tokens", "layers", "norm")
TAKES = ("It takes transformers' decoder-only causal LMs built as embed_tokens -> layers -> norm whose layers "
         "use full or sliding-window attention")
MIN_TRANSFORMERS = 5  # the layer and mask signatures (``cache``), ``core_model_loading``'s key conversions


class AdapterError(ValueError):
    """A model the transformers adapter cannot run as pipeline stages: ``reason``, then where the docs say what
    it takes."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; see {DOCS}")
        self.reason = reason


def require_transformers() -> Any:
    """The ``transformers`` module (>= 5), or an ``AdapterError`` saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise AdapterError("the transformers adapter needs transformers >= 5 (pip install 'transformers>=5')"
                           ) from None
    major = int(importlib.metadata.version("transformers").split(".")[0])
    if major < MIN_TRANSFORMERS:
        raise AdapterError(f"the transformers adapter needs transformers >= {MIN_TRANSFORMERS}, found "
                           f"{transformers.__version__}")
    return transformers


def hf_config(data: Mapping[str, Any] | Any) -> Any:
    """A transformers config object from a ``config.json`` dict (or the object itself)."""
    transformers = require_transformers()
    if isinstance(data, transformers.PretrainedConfig):
        return data
    model_type = data.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise AdapterError(f"transformers {transformers.__version__} does not know model_type {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(dict(data))


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type as the model's body picks its mask: ``config.layer_types`` where the config
    has it, else sliding-window everywhere when ``sliding_window`` is set (Mistral, Mixtral, Phi-3), else full."""
    count = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if sliding else "full_attention"] * count
    return list(types)[:count]


def refusal(config: Any) -> str | None:
    """Why the adapter cannot take ``config`` (a transformers config), or None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type!r} is an encoder-decoder model"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"transformers has no causal LM class for {model_type!r}"
    if "text_config" in getattr(config, "sub_configs", {}):
        return "it is a multimodal model (the adapter takes its text decoder's own checkpoint, text_config)"
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if not set(PIPELINE_PARTS) <= set(plan):
        return (f"{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]} is not built as embed_tokens -> layers -> norm "
                f"(transformers' base_model_pp_plan for it: {sorted(plan) or 'none'})")
    other = sorted(set(layer_types(config)) - set(ATTENTION_TYPES))
    if other:
        return (f"it has layers of type {other}; the adapter rebuilds the masks of {list(ATTENTION_TYPES)} layers "
                "only")
    for flag, why in (("use_bidirectional_attention", "bidirectional attention"),
                      ("output_router_logits", "output_router_logits=True (the balance loss over every layer's "
                                               "router logits at once, which no pipeline stage holds)")):
        if getattr(config, flag, False):
            return f"it uses {why}"
    if getattr(config, "quantization_config", None):
        return "it is a quantized checkpoint (quantization_config)"
    return None


def refusal_of(data: Mapping[str, Any]) -> str | None:
    """Why the adapter cannot take the model of ``config.json`` dict ``data``, or None: ``refusal`` of its
    transformers config, or that transformers is missing or does not know its ``model_type``."""
    try:
        return refusal(hf_config(data))
    except AdapterError as exc:
        return exc.reason


def check_adaptable(config: Any) -> Any:
    """``config`` (a transformers config) when the adapter takes it; an ``AdapterError`` with the reason otherwise."""
    reason = refusal(config)
    if reason is not None:
        raise AdapterError(f"the transformers adapter cannot take model_type {config.model_type!r}: {reason}. "
                           f"{TAKES}")
    return config
