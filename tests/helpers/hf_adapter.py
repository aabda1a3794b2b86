"""Tiny transformers models of six families the library has no native family for, for the adapter's tests.

Each is written by transformers' ``save_pretrained`` (so its checkpoint is in the layout transformers writes,
Mixtral's experts one tensor each) with random weights (``hf_reference.randomize``: a wrong mask, scale or
rotary shows), 4 layers (one per stage of a V on 2 ranks) and features that a stage must rebuild: Qwen2 tied,
Mistral and Gemma3's sliding windows (4 tokens, shorter than the test sequences), Gemma3's per-layer attention
types, tied head, softcap and embedding scale, Mixtral's experts, Phi-3's fused projections, OLMo2's q/k norms.
``batch`` makes next-token data holding pad tokens (masked in the labels), where the model has a pad id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.hf_reference import randomize

VOCAB, SEQ, ROWS_PER_MB, NUM_MB = 64, 12, 2, 4
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)

FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (transformers config class, config fields, from_pretrained keyword arguments)
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, pad_token_id=0), {}),
    "mistral": ("MistralConfig", dict(sliding_window=4), {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, pad_token_id=0),
                {"experts_implementation": "eager"}),  # grouped_mm has no float64 CPU kernel
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=4, final_logit_softcapping=3.0,
                                             layer_types=["sliding_attention", "full_attention"] * 2,
                                             pad_token_id=0), {}),
    "phi3": ("Phi3Config", dict(pad_token_id=0), {}),  # its default pad id (32000) is outside a small vocabulary
    "olmo2": ("Olmo2Config", dict(pad_token_id=0), {}),
}


def hf_config(name: str) -> Any:
    import transformers

    cls, fields, _ = FAMILIES[name]
    return getattr(transformers, cls)(**_SMALL, **fields)


def save_tiny(name: str, folder: Path, seed: int = 0) -> Path:
    """Family ``name``'s tiny model, random weights, float64, written by transformers into ``folder``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float64)
    randomize(model, seed + 1)
    model.save_pretrained(folder)
    return folder


def load_reference(name: str, folder: Path) -> Any:
    """transformers' own model of the folder, float64 (what the adapter is compared with)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **FAMILIES[name][2])


def batch(pad_token_id: int | None, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) of ``NUM_MB * ROWS_PER_MB`` rows: next tokens, pad tokens at some rows' ends (their targets
    -100) and a different number of masked targets in every micro-batch."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (NUM_MB * ROWS_PER_MB, SEQ + 1), generator=g)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(x.shape[0]):
        pad = row % 5
        if pad:
            if pad_token_id is not None:
                x[row, -pad:] = pad_token_id
            y[row, -pad:] = -100
    return x, y
