"""The families, in one table: ``from_pretrained(path)`` reads ``config.json``'s ``model_type``, and the planner
takes a family's preset by name or its ``config.json`` as shipped (``planner_specs.py``).

A ``model_type`` with no native family here loads through ``ADAPTER``, the transformers adapter
(``models/transformers_adapter``), when it is a transformers decoder-only causal LM the adapter takes; otherwise
the error names the native families, the adapter's reason and ``ADAPTER_DOCS``. Native families stay native: the
table is looked up first.

A family is registered by ``model_type`` -> ``Family`` (its package, model class and config class, the names
``mt-dualpipe plan --model`` knows its presets by, and the Hugging Face config keys that shape the planner's
model, and what a plan says of the family: ``planned``, a ``planner.families.PlannedFamily``) and imported
only when asked for, so loading a Qwen3-MoE checkpoint never imports DeepSeek-V3 and vice
versa. The model class offers ``from_pretrained(path, **kwargs)`` (and ``save_pretrained`` back to the same
layout); the config class ``preset(name, **overrides)`` and ``from_hf(data, **overrides)``.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..planner.families import (
    DEEPSEEK_V3,
    FAMILY_EXAMPLE,
    SHARED_SAVERS,
    SHARED_SELECTIVE,
    PlannedFamily,
)


@dataclass(frozen=True)
class PlannerName:
    """A name ``mt-dualpipe plan --model`` takes for one of the family's presets, and the plan's name for it."""

    name: str
    preset: str
    plan_name: str


@dataclass(frozen=True)
class Family:
    module: str  # the family's package
    model_class: str  # the whole model (``from_pretrained`` / ``save_pretrained``)
    config_class: str  # ``preset(name, **overrides)`` and ``from_hf(data, **overrides)``
    planner_names: tuple[PlannerName, ...] = ()
    cost_keys: tuple[str, ...] = ()  # config.json keys the planner's model is built from (sizes and counts)
    planned: PlannedFamily | None = None  # what a plan says of the family (None: the planner does not take it)

    def load(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.module), attr)


_GQA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings")

FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("mt_dualpipe.models.qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        (PlannerName("qwen3-moe", "30b-a3b", "qwen3_30b_a3b"),
                         PlannerName("qwen3-30b-a3b", "30b-a3b", "qwen3_30b_a3b")),
                        _GQA_KEYS + ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                     "decoder_sparse_step", "mlp_only_layers"),
                        PlannedFamily("qwen3_moe", "Qwen3-MoE",
                                      "layers/moe.py: the Experts of models/qwen3_moe/model.py's MoE blocks, this "
                                      "rank's share over its ep group",
                                      "its modules' saved_per_token declarations, models/qwen3_moe/spec.py",
                                      SHARED_SELECTIVE, ("norm", "swiglu", "combine", "attention", "loss"),
                                      example=FAMILY_EXAMPLE, tiny_experts=4, tiny_layers=4)),
    "llama": Family("mt_dualpipe.models.llama", "LlamaForCausalLM", "LlamaConfig",
                    (PlannerName("llama3-8b", "8b", "llama3_8b"), PlannerName("llama-3.1-8b", "8b", "llama3_8b")),
                    _GQA_KEYS,
                    PlannedFamily("llama", "Llama", "",
                                  "its modules' saved_per_token declarations, models/llama/spec.py", SHARED_SELECTIVE,
                                  SHARED_SAVERS, example=FAMILY_EXAMPLE, tiny_layers=4)),
    "deepseek_v3": Family("mt_dualpipe.models.deepseek_v3", "DeepSeekV3Model", "DeepSeekV3Config", (),
                          ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                           "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "n_routed_experts",
                           "n_shared_experts", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank",
                           "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers"),
                          replace(DEEPSEEK_V3, saved_code="its modules' saved_per_token declarations, "
                                                          "models/deepseek_v3/spec.py")),
    "llava": Family("mt_dualpipe.models.llava", "LlavaForConditionalGeneration", "LlavaConfig"),
}


def planned_families() -> dict[str, PlannedFamily]:
    """``model_type`` -> what a plan says of the family, for every family the planner takes."""
    return {t: f.planned for t, f in FAMILIES.items() if f.planned is not None}


ADAPTER = Family("mt_dualpipe.models.transformers_adapter", "AdaptedCausalLM", "AdaptedConfig")
"""Every other transformers decoder-only causal LM: the model's own modules cut into stages (no planner presets)."""
ADAPTER_DOCS = 'docs/models.md, section "Any transformers decoder-only model"'


def register_family(model_type: str, module: str, class_name: str, config_class: str = "") -> None:
    """Make ``from_pretrained`` load ``model_type`` checkpoints with ``module.class_name``."""
    FAMILIES[model_type] = Family(module, class_name, config_class)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (the file, or the folder holding it) as a dict."""
    cfg = Path(path)
    if cfg.is_dir():
        cfg = cfg / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face checkpoint folder)")
    data = json.loads(cfg.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{cfg} holds a {type(data).__name__}, not a config object")
    return data


def model_type_of(path: str | os.PathLike) -> str:
    model_type = read_config(path).get("model_type")
    if not model_type:
        raise ValueError(f"{path} has no model_type")
    return str(model_type)


def family_entry(model_type: str) -> Family:
    """The native ``Family`` of ``model_type`` (what the planner describes; a clear error naming the registered
    ones and the adapter otherwise)."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; registered: {sorted(FAMILIES)}. Other "
                         "transformers decoder-only causal LMs load through the transformers adapter "
                         f"(mt_dualpipe.from_pretrained), which has no presets or planner description ({ADAPTER_DOCS})")
    return FAMILIES[model_type]


def entry_for(config: dict[str, Any]) -> Family:
    """The ``Family`` that loads the model of ``config.json`` dict ``config``: the native one of its
    ``model_type``, else ``ADAPTER`` when the transformers adapter takes it; otherwise an error naming both."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    reason = ADAPTER.load("refusal_of")(config)
    if reason is not None:
        takes = ADAPTER.load("TAKES")
        raise ValueError(f"model_type {model_type!r} is not supported: it has no native family (registered: "
                         f"{sorted(FAMILIES)}) and the transformers adapter cannot take it: {reason}. {takes}; see "
                         f"{ADAPTER_DOCS}")
    return ADAPTER


def family(model_type: str) -> type:
    """The model class that loads ``model_type`` (imported now): its native family's, or the transformers
    adapter's when the adapter takes that type's default config."""
    entry = entry_for({"model_type": model_type})
    return entry.load(entry.model_class)


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Any:
    """The model of a Hugging Face folder: its native family's, or an ``AdaptedCausalLM`` (any transformers
    decoder-only causal LM the adapter takes); ``kwargs`` (``dtype``, ``device``, config overrides, ...) go to
    that class's ``from_pretrained``."""
    model_type_of(path)  # a folder without a model_type is refused as such
    entry = entry_for(read_config(path))
    return entry.load(entry.model_class).from_pretrained(path, **kwargs)
