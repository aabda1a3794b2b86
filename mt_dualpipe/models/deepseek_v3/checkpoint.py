"""DeepSeek-V3 weights from and to Hugging Face checkpoints (the released layout), for a whole model
or for the stages one pipeline rank holds.

A model or stage is built on the meta device, given storage, and filled by
``hf_checkpoint.load_module``: only the tensors of its own parameters are read (a stage's blocks; an
expert-parallel shard's own experts), so no rank ever holds another stage's weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..hf_checkpoint import (
    DEFAULT_SHARD_BYTES,
    FP8_QUANTIZATION_CONFIG,
    Checkpoint,
    CheckpointError,
    build_on_meta,
    load_module,
    prepare_tensors,
    save_tensors,
)
from .config import DeepSeekV3Config
from .hf_names import is_fp8_weight, is_fp32_weight, shared_copies, to_hf_name

PathLike = str | os.PathLike


def open_checkpoint(checkpoint: PathLike | Checkpoint) -> Checkpoint:
    return checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)


def hf_state_dict(module: nn.Module, config: DeepSeekV3Config) -> dict[str, torch.Tensor]:
    """``module``'s tensors under their checkpoint names, plus the MTP layers' embedding/head copies."""
    out: dict[str, torch.Tensor] = {}
    for key, t in module.state_dict().items():
        out[to_hf_name(key, config)] = t
        for copy in shared_copies(key, config):
            out[copy] = t
    return out


def _check_mtp(ckpt: Checkpoint, module: nn.Module, config: DeepSeekV3Config) -> None:
    if not any(k.startswith("mtp.") for k in module.state_dict()):
        return
    prefix = f"model.layers.{config.n_layers}."
    if not any(n.startswith(prefix) for n in ckpt.weight_map):
        raise CheckpointError(f"{ckpt.path} has no MTP layer ({prefix}*) but the config asks for "
                              f"mtp_depth={config.mtp_depth} (num_nextn_predict_layers); checkpoints saved by "
                              "transformers omit it: load with mtp_depth=0")


def load_weights(module: nn.Module, checkpoint: PathLike | Checkpoint, config: DeepSeekV3Config) -> list[str]:
    """Fill a ``DeepSeekV3Model`` or stage (built for ``config``) from a checkpoint; returns the names read.

    The router's correction bias is zero when the checkpoint has none and ``topk_method`` does not use
    it (DeepSeek-V2-style routing); every other tensor must be present."""
    ckpt = open_checkpoint(checkpoint)
    _check_mtp(ckpt, module, config)
    to_hf = _namer(config)
    absent_bias = {k for k in module.state_dict() if k.endswith("gate.e_score_correction_bias") and to_hf(k) not in ckpt
                   and config.topk_method != "noaux_tc"}
    with torch.no_grad():
        for k in absent_bias:
            module.get_buffer(k).zero_()
    return load_module(module, ckpt, to_hf, skip=absent_bias.__contains__)


def _namer(config: DeepSeekV3Config) -> Callable[[str], str]:
    return lambda key: to_hf_name(key, config)


def build_loaded(factory: Callable[[], nn.Module], checkpoint: PathLike | Checkpoint, config: DeepSeekV3Config, *,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu", fp8: bool = False) -> nn.Module:
    """``factory()`` built on the meta device (no init pass), given storage on ``device`` in ``dtype``,
    then loaded from ``checkpoint``. ``fp8``: convert the linears to ``FP8Linear`` first, so an FP8
    checkpoint's weights and block scales become their quantised weights as stored."""
    module = build_on_meta(factory, dtype=dtype, device=device, fp8=fp8)
    load_weights(module, checkpoint, config)
    return module


def save_weights(module: nn.Module, config: DeepSeekV3Config, path: PathLike, *, dtype: torch.dtype | None = None,
                 fp8: bool = False, max_shard_size: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``module`` (a whole model) as a Hugging Face checkpoint: ``config.json``, shards, index.
    ``fp8``: the projections as E4M3 with 128×128 block ``weight_scale_inv`` (the released format)."""
    hf_config = config.to_hf()
    if fp8:
        hf_config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    tensors = prepare_tensors(hf_state_dict(module, config).items(), dtype=dtype,
                              fp8=is_fp8_weight if fp8 else None, keep_fp32=is_fp32_weight)
    return save_tensors(tensors, path, hf_config, max_shard_size=max_shard_size)
