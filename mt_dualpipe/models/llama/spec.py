"""The planner's model description of a Llama config (``planner.model.ModelSpec``).

Sizes, parameters and FLOPs are the planner's dense GQA layer (``ModelSpec.from_llama_config``). What a
layer keeps for backward is not described again here: ``declared_saved`` reads the decoder layer's
``saved_per_token`` declarations (``layers.saved_elements_per_token``), the same modules the recompute
policies act on, so a change to a layer changes the plan with it. The declarations count elements of
the model dtype: a plan with FP8 linears is still counted as if their inputs were kept in that dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from ...layers import saved_elements_per_token
from ...planner.model import ModelSpec
from .config import LlamaConfig
from .model import LlamaDecoderLayer


def declared_saved(config: LlamaConfig) -> Callable[[str, str, int], float]:
    """(kind, policy, seq) -> saved elements per token of one decoder layer (every Llama layer is
    ``"dense"``), from its modules' declarations; the layer is built once on the meta device (no memory,
    any size)."""

    @functools.cache
    def layer() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaDecoderLayer(config)

    def per_token(kind: str, policy: str, seq: int, t: object = None) -> float:
        if kind != "dense":
            raise ValueError(f"a Llama layer is dense, not {kind!r}")
        kept_input = config.hidden_size if policy == "full" else 0  # a fully recomputed layer keeps its input
        return float(saved_elements_per_token(layer(), policy, seq) + kept_input)

    return per_token


def planner_spec(config: LlamaConfig) -> ModelSpec:
    """The planner's ``ModelSpec`` of ``config``, its saved bytes read from the modules' declarations."""
    return dataclasses.replace(ModelSpec.from_llama_config(config), declared_saved=declared_saved(config))
