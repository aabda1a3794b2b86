"""Qwen3-MoE weights from and to Hugging Face checkpoints through the shared lazy loader
(``models/hf_checkpoint.py``): names are identical, so the mapping is the identity and a stage
or an expert shard reads exactly its own tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    build_loaded,
    open_checkpoint,
    prepare_tensors,
    save_tensors,
)

__all__ = ["build_loaded", "open_checkpoint", "save_weights"]


def save_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | None = None) -> Path:
    tensors = prepare_tensors(model.hf_state_dict().items(), dtype=dtype)
    return save_tensors(tensors, path, model.config.to_hf(), max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)
