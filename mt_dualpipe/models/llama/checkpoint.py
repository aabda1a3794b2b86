"""Llama weights from and to Hugging Face checkpoints, through the shared lazy loader."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ...integrations.hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    FP8_QUANTIZATION_CONFIG,
    Checkpoint,
    build_on_meta,
    load_module,
    prepare_tensors,
    save_tensors,
)


def open_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> Checkpoint:
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def is_fp8_weight(name: str) -> bool:
    """The projections of attention and MLP (not embedding, head or norms) are stored in FP8."""
    return bool(re.search(r"\.(self_attn|mlp)\.[a-z]+_proj\.weight$", name))


def build_loaded(factory: Callable[[], nn.Module], checkpoint: str | os.PathLike | Checkpoint, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu", fp8: bool = False) -> nn.Module:
    """Build on meta, give storage, optionally convert to FP8, load this module's own tensors."""
    module = build_on_meta(factory, dtype=dtype, device=device, fp8=fp8)
    load_module(module, open_checkpoint(checkpoint), lambda key: key)
    return module


def save_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None, fp8: bool = False,
                 max_shard_size: int | None = None) -> Path:
    config = model.config.to_hf()
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    tensors = prepare_tensors(model.hf_state_dict().items(), dtype=dtype, fp8=is_fp8_weight if fp8 else None)
    return save_tensors(tensors, path, config, max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)
