"""Qwen3-MoE weights from and to Hugging Face checkpoints through the shared lazy loader
(``integrations/hf_checkpoint.py``): names are identical, so the mapping is the identity and a stage
or an expert shard reads exactly its own tensors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ...integrations.hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    build_on_meta,
    load_module,
    prepare_tensors,
    save_tensors,
)


def open_checkpoint(checkpoint: str | os.PathLike | Checkpoint) -> Checkpoint:
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def build_loaded(factory: Callable[[], nn.Module], checkpoint: str | os.PathLike | Checkpoint, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """Build on meta, give storage, load this module's own tensors (and nothing else)."""
    module = build_on_meta(factory, dtype=dtype, device=device)
    load_module(module, open_checkpoint(checkpoint), lambda key: key)
    return module


def save_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | None = None) -> Path:
    tensors = prepare_tensors(model.hf_state_dict().items(), dtype=dtype)
    return save_tensors(tensors, path, model.config.to_hf(), max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)
