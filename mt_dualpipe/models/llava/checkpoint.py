"""LLaVA weights from and to Hugging Face checkpoints, in any of the key layouts found in the wild.

The modules carry transformers 5's in-memory names (``model.vision_tower.*``, ``model.multi_modal_projector.*``,
``model.language_model.*``, ``lm_head.*``) and that is the layout written. Reading accepts, per part,
whichever prefix the checkpoint uses, detected from its index (names only, no tensor is read):

- vision tower: ``model.vision_tower.`` (ours), ``vision_tower.`` (what transformers 5's default
  ``save_pretrained`` writes: it reverts to the original format but without CLIP's ``vision_model.``),
  ``vision_tower.vision_model.`` (the hub's older checkpoints), ``model.vision_tower.vision_model.``;
- projector: ``model.multi_modal_projector.`` (ours), ``multi_modal_projector.``;
- language model: ``model.language_model.`` (ours), ``language_model.model.``;
- head: ``lm_head.`` (ours), ``language_model.lm_head.``.

The mapping is a prefix swap, so a pipeline stage still reads exactly its own tensors through the shared
lazy loader (``models/hf_checkpoint.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    Checkpoint,
    CheckpointError,
    open_checkpoint,
    prepare_tensors,
    save_tensors,
)
from ..hf_checkpoint import build_loaded as _build_loaded

OURS = {"vision": "model.vision_tower.", "projector": "model.multi_modal_projector.",
        "text": "model.language_model.", "head": "lm_head."}
ACCEPTED = {  # longest first: "model.vision_tower." is also a prefix of "model.vision_tower.vision_model."
    "vision": ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
               "vision_tower."),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector."),
    "text": ("model.language_model.", "language_model.model."),
    "head": ("lm_head.", "language_model.lm_head."),
}


@dataclass(frozen=True)
class KeyLayout:
    """The checkpoint prefix of each part (``OURS`` keys -> a prefix of ``ACCEPTED``)."""

    prefixes: tuple[tuple[str, str], ...]

    @classmethod
    def ours(cls) -> KeyLayout:
        return cls(tuple(OURS.items()))

    @classmethod
    def detect(cls, names: Iterable[str]) -> KeyLayout:
        """Per part, the first accepted prefix some checkpoint name starts with (ours when none does: a
        tied checkpoint has no head, and a missing part is reported by the loader with its name)."""
        names = list(names)
        found = []
        for part, options in ACCEPTED.items():
            hit = next((p for p in options if any(n.startswith(p) for n in names)), OURS[part])
            found.append((part, hit))
        return cls(tuple(found))

    def to_checkpoint(self, key: str) -> str:
        """Our state-dict key -> the checkpoint's name."""
        for part, prefix in self.prefixes:
            if key.startswith(OURS[part]):
                return prefix + key[len(OURS[part]):]
        raise CheckpointError(f"{key} belongs to no LLaVA part ({sorted(OURS.values())})")


def build_loaded(factory: Callable[[], nn.Module], checkpoint: str | os.PathLike | Checkpoint, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """Build on meta, give storage, load this module's own tensors (and nothing else) in the
    checkpoint's layout."""
    ckpt = open_checkpoint(checkpoint)
    return _build_loaded(factory, ckpt, dtype=dtype, device=device,
                         to_checkpoint=KeyLayout.detect(ckpt.names()).to_checkpoint)


def save_weights(model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 max_shard_size: int | None = None) -> Path:
    """config.json, safetensors shards and index in transformers 5's layout (our names)."""
    tensors = prepare_tensors(model.hf_state_dict().items(), dtype=dtype)
    return save_tensors(tensors, path, model.config.to_hf(), max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)
