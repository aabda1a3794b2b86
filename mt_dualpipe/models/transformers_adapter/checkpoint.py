"""An adapted stage's modules and tensors: built from a skeleton on the meta device, filled per stage.

``skeleton(config)`` is the whole transformers model on the meta device (no memory, no init): a stage deep-copies
its modules from it, so they are the model's own classes with the model's own names. Materialised, a stage's
modules are initialised by the model's own ``_init_weights`` (a fresh stage: everything; a stage about to be
loaded: only the modules holding non-persistent buffers, the rotary frequencies and Gemma's embedding scale,
which no checkpoint stores), exactly as transformers' ``from_pretrained`` finishes a model built on meta.

``read_stage`` fills a stage from a Hugging Face checkpoint reading only the stage's tensors (``hf_checkpoint``'s
lazy ``Checkpoint``). A checkpoint stores some models in another layout than their modules (Mixtral: one tensor
per expert on disk, ``experts.gate_up_proj`` fused in memory); transformers' own conversion table
(``conversion_mapping.get_model_conversion_mapping``) maps each checkpoint name to the module key it feeds, so a
stage reads exactly the names that feed its keys and converts them as transformers does, one key at a time.
``checkpoint_tensors`` reverts it (``core_model_loading.revert_weight_conversion``) for saving, so a stage writes
the layout transformers writes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..hf_checkpoint import Checkpoint, CheckpointError
from .config import AdaptedConfig
from .support import require_transformers


def skeleton(config: AdaptedConfig, **options: Any) -> Any:
    """The whole transformers causal LM of ``config`` on the meta device; ``options`` (``attn_implementation``,
    ``experts_implementation``) go to transformers' ``from_config``."""
    transformers = require_transformers()
    options = {k: v for k, v in options.items() if v is not None}
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config.hf), **options)


def _has_own_nonpersistent_buffers(module: nn.Module) -> bool:
    return bool(getattr(module, "_non_persistent_buffers_set", ()))


def _clear_init_marks(module: nn.Module) -> None:
    """transformers' init functions skip a tensor (or module) marked initialised; copies of the skeleton's may be."""
    for m in module.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized


@torch.no_grad()
def initialize(stage: nn.Module, model: Any, fresh: bool) -> None:
    """The model's ``_init_weights`` on the stage's modules: all of them (``fresh``), or only those holding
    non-persistent buffers (their values are computed, not stored)."""
    _clear_init_marks(stage)
    for m in stage.modules():
        if fresh or _has_own_nonpersistent_buffers(m):
            model._init_weights(m)


def _conversions(model: Any) -> tuple[list[Any], list[Any]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return ([t for t in mapping if isinstance(t, WeightRenaming)],
            [t for t in mapping if isinstance(t, WeightConverter)])


def stage_sources(model: Any, names: Iterable[str], keys: Iterable[str]) -> dict[str, tuple[str, str | None]]:
    """Checkpoint name -> (the module key it feeds, the conversion pattern that takes it or None), for the names
    of ``names`` that feed one of ``keys``."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model)
    meta = model.state_dict()
    wanted = set(keys)
    out: dict[str, tuple[str, str | None]] = {}
    for name in names:
        key, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if key in wanted:
            out[name] = (key, pattern)
    return out


@torch.no_grad()
def read_stage(stage: nn.Module, model: Any, ckpt: Checkpoint) -> list[str]:
    """Fill ``stage``'s parameters and persistent buffers from ``ckpt``, reading only the names that feed them
    (converted as transformers converts them); returns the names read."""
    from transformers.core_model_loading import dot_natural_key

    targets = dict(stage.state_dict(keep_vars=True))
    sources = stage_sources(model, ckpt.names(), targets)
    missing = sorted(set(targets) - {key for key, _ in sources.values()})
    if missing:
        raise CheckpointError(f"{ckpt.path}: no tensor of the checkpoint feeds {len(missing)} of this stage's "
                              f"keys, e.g. {missing[:3]}")
    _, converters = _conversions(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    expected: dict[str, int] = {}
    for key, pattern in sources.values():
        if pattern is not None:
            expected[key] = expected.get(key, 0) + 1
    pending: dict[str, Any] = {}
    order = sorted(sources, key=dot_natural_key)
    for name, tensor in ckpt.read(order):
        key, pattern = sources[name]
        if pattern is None:  # the same tensor, maybe renamed
            _assign(targets, {key: tensor}, ckpt)
            continue
        transform = pending.setdefault(key, copy.deepcopy(by_pattern[pattern]))
        transform.add_tensor(key, name, pattern, tensor)
        expected[key] -= 1
        if expected[key] == 0:  # every source of this key read: convert and copy it now, keep nothing
            _assign(targets, pending.pop(key).convert(key, model=model, config=model.config), ckpt)
    return order


def _assign(targets: dict[str, torch.Tensor], converted: dict[str, Any], ckpt: Checkpoint) -> None:
    for key, value in converted.items():
        value = value[0] if isinstance(value, list) else value
        if key not in targets:
            continue  # a conversion that yields more than this stage holds
        if tuple(value.shape) != tuple(targets[key].shape):
            raise CheckpointError(f"{ckpt.path}: {key} has shape {tuple(value.shape)} in the checkpoint, but the "
                                  f"stage needs {tuple(targets[key].shape)}")
        targets[key].copy_(value)


def checkpoint_tensors(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (module keys) in the layout transformers writes to a checkpoint."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(state)))
