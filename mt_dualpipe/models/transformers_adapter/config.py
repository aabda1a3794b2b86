"""``AdaptedConfig``: a transformers config, checked once, with the few names a pipeline stage reads.

The registry asks every family's config class for ``from_hf(data)`` and ``to_hf()``; for an adapted model both
are transformers' own (``from_dict`` / ``to_dict``), so every field round-trips as transformers writes it. What
the stages need (the layer count, the tie, the vocabulary) is read from it, not copied, so the two cannot drift.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .support import check_adaptable, hf_config


@dataclass(frozen=True, eq=False)
class AdaptedConfig:
    """``hf``: the transformers config (``Qwen2Config``, ``Gemma3TextConfig``, ...), accepted by
    ``support.check_adaptable``."""

    hf: Any

    def __post_init__(self) -> None:
        check_adaptable(self.hf)

    @classmethod
    def from_hf(cls, data: Mapping[str, Any] | Any, **overrides: Any) -> AdaptedConfig:
        """From a ``config.json`` dict (or a transformers config, copied); ``overrides`` set config attributes."""
        config = copy.deepcopy(hf_config(data))
        for key, value in overrides.items():
            setattr(config, key, value)
        return cls(config)

    def to_hf(self) -> dict[str, Any]:
        return self.hf.to_dict()

    @property
    def model_type(self) -> str:
        return str(self.hf.model_type)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.hf.hidden_size)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.hf, "tie_word_embeddings", False))

    def __repr__(self) -> str:
        return (f"AdaptedConfig({self.model_type}, {self.num_hidden_layers} layers, hidden {self.hidden_size}, "
                f"vocab {self.vocab_size}, tied={self.tie_word_embeddings})")
