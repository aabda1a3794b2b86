"""One stage entry for every family, native or adapted: ``stages_for_rank(model, schedule, rank)`` and
``criterion_for(stages)``.

Each family has its own ``stages_for_rank(config, schedule, rank, layout, source=... | checkpoint=...)``; this
entry picks it from what it is given: a model of a family (what ``from_pretrained`` returns: a native family's
model, or an ``AdaptedCausalLM``), a transformers causal LM (wrapped by the adapter), or a Hugging Face
checkpoint folder (read per stage: each rank reads only its stages' tensors). From a model, the stages take its
dtype. ``criterion_for`` is the shared one: every family's last stage offers ``criterion(h, labels,
normalizer=None)``.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from .decoder_stage import criterion_for
from .registry import ADAPTER, ADAPTER_DOCS, FAMILIES, Family, entry_for, read_config

__all__ = ["criterion_for", "family_of", "stages_for_rank"]


def _is_transformers_model(model: Any) -> bool:
    transformers = sys.modules.get("transformers")  # holding one, the caller has imported transformers
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def family_of(model: nn.Module) -> Family:
    """The ``Family`` whose package defines ``model``'s class (native, or the adapter)."""
    home = type(model).__module__
    for entry in (*FAMILIES.values(), ADAPTER):
        if home == entry.module or home.startswith(entry.module + "."):
            return entry
    raise TypeError(f"stages_for_rank takes a model from mt_dualpipe.from_pretrained (a family's model or an "
                    f"AdaptedCausalLM), a transformers causal LM or a checkpoint folder; got {type(model).__name__} "
                    f"({ADAPTER_DOCS})")


def _accepts(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def stages_for_rank(model: nn.Module | str | os.PathLike, schedule: Any, rank: int,
                    layout: Sequence[int] | str | None = None, **kwargs: Any) -> list[nn.Module]:
    """This rank's stage modules of ``model`` for ``schedule`` (a ``Schedule`` or placement), in the order the
    ``Pipeline`` takes them. ``model``: a family's model (its weights are copied), a transformers causal LM, or a
    checkpoint folder (each stage reads only its tensors). ``layout`` and ``kwargs`` (``recompute``,
    ``defer_weight_grads``, ``dtype``, ...) go to the family's own ``stages_for_rank``."""
    if isinstance(model, (str, os.PathLike)):
        data = read_config(model)
        entry = entry_for(data)
        config = entry.load(entry.config_class).from_hf(data)
        return entry.load("stages_for_rank")(config, schedule, rank, layout, checkpoint=model, **kwargs)
    if _is_transformers_model(model):
        model = ADAPTER.load(ADAPTER.model_class)(model)
    entry = family_of(model)
    dtype = next(model.parameters()).dtype
    recast = "dtype" not in kwargs and not _accepts(entry.load("build_stages"), "dtype")
    if "dtype" not in kwargs and not recast:
        kwargs["dtype"] = dtype
    stages = entry.load("stages_for_rank")(model.config, schedule, rank, layout, source=model, **kwargs)
    for stage in stages if recast else ():  # built in the default dtype: cast, then copy the weights again
        if any(p.dtype != dtype for p in stage.parameters() if p.is_floating_point()):
            stage.to(dtype)
            stage.load_from(model)
    return stages
