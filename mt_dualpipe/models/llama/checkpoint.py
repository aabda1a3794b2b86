"""Llama weights from and to Hugging Face checkpoints, through the shared lazy loader."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from ..hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    FP8_QUANTIZATION_CONFIG,
    build_loaded,
    open_checkpoint,
    prepare_tensors,
    save_tensors,
)

__all__ = ["build_loaded", "is_fp8_weight", "open_checkpoint", "save_weights"]


def is_fp8_weight(name: str) -> bool:
    """The projections of attention and MLP (not embedding, head or norms) are stored in FP8."""
    return bool(re.search(r"\.(self_attn|mlp)\.[a-z]+_proj\.weight$", name))


def save_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None, fp8: bool = False,
                 max_shard_size: int | None = None) -> Path:
    config = model.config.to_hf()
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    tensors = prepare_tensors(model.hf_state_dict().items(), dtype=dtype, fp8=is_fp8_weight if fp8 else None)
    return save_tensors(tensors, path, config, max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)
