"""Qwen3-MoE cut into pipeline stages for any placement (linear, V, dual, interleaved).

A stage holds a contiguous run of decoder layers; the first also the embedding, the last the final norm
and the head (with tied embeddings its own copy of ``model.embed_tokens``, declared in
``tied_parameters`` so a ``Pipeline`` sums the copies' gradients). Names are the full model's (= the
checkpoint's), so ``build_stages(..., checkpoint=path)`` reads exactly a stage's tensors. The contract
and everything else a family's stage shares: ``models/decoder_stage.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...fp8 import convert_to_fp8
from ...layers import deferred_init, lm_head
from ..decoder_stage import DecoderStage, build_stage_list, criterion_for, local_stage_indices
from ..decoder_stage import stage_layer_ids as _split_layers
from .checkpoint import build_loaded
from .config import Qwen3MoeConfig
from .model import Qwen3MoeBody, init_qwen3_moe

__all__ = ["Qwen3MoeStage", "build_stages", "criterion_for", "stage_layer_ids", "stages_for_rank"]


def stage_layer_ids(config: Qwen3MoeConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Layers per stage: ``layout`` counts, or balanced (``decoder_stage.stage_layer_ids``)."""
    return _split_layers(config.num_hidden_layers, num_stages, layout)


class Qwen3MoeStage(DecoderStage):
    def __init__(self, config: Qwen3MoeConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(config, index, num_stages)
        with deferred_init():
            self.model = Qwen3MoeBody(config, list(layer_ids), embed=self.holds_embedding, norm=self.is_last,
                                      ep_group=ep_group)
            if self.is_last and not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_qwen3_moe(self, config.initializer_range)
        self.finish_init(defer_weight_grads)


def build_stages(config: Qwen3MoeConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None, checkpoint: Any = None,
                 dtype: torch.dtype | None = None, defer_weight_grads: bool = True,
                 recompute: str = "none", ep_group: dist.ProcessGroup | None = None,
                 compile: bool | str = False, fp8: bool = False) -> list[Qwen3MoeStage]:
    """The stage modules (all, or ``indices``): weights copied from ``source``, read per stage from a
    Hugging Face ``checkpoint`` (only the stage's own tensors), or freshly initialised. ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``models/recompute.py``). ``ep_group``: each MoE layer
    holds (and reads) only this rank's experts. ``compile``: True (inductor) or a backend name compiles each
    layer's memory-bound parts (``DecoderStage.compile_targets``), linears kept out of the graph. ``fp8``
    converts the linears (attention, dense and expert SwiGLUs; not the router or the head) to ``FP8Linear``
    (1x128 activation tiles, 128x128 weight blocks), before loading when reading a checkpoint."""
    ids = stage_layer_ids(config, num_stages, layout)

    def make(i: int) -> Qwen3MoeStage:
        return Qwen3MoeStage(config, i, num_stages, ids[i], defer_weight_grads, ep_group)

    return build_stage_list(make, range(num_stages) if indices is None else indices, source=source,
                            checkpoint=checkpoint,
                            load=lambda factory, ckpt: build_loaded(factory, ckpt, dtype=dtype, fp8=fp8), dtype=dtype,
                            prepare=convert_to_fp8 if fp8 else None, recompute=recompute, compile=compile)


def stages_for_rank(config: Qwen3MoeConfig, schedule: Any, rank: int, layout: Sequence[int] | None = None,
                    **kwargs: Any) -> list[Qwen3MoeStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects); ``kwargs`` go to ``build_stages``."""
    num, wanted = local_stage_indices(schedule, rank)
    return build_stages(config, num, layout, indices=wanted, **kwargs)
