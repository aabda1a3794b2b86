"""Llama cut into pipeline stages for any placement (linear, V, dual, interleaved).

A stage holds a contiguous run of decoder layers; the first also the embedding, the last the final
norm and the head (with tied embeddings its own copy of ``model.embed_tokens``, declared in
``tied_parameters``: a ``Pipeline`` sums the copies' gradients, ``layers.replicas.sync_replicas`` does for
a loop without one).
Layers come from ``model.py`` (the shared ``mt_dualpipe.layers``); what every family's stage shares
(the contract ``stage(x)`` -> hidden states, ``criterion(hidden, labels, normalizer=None)``, the layer
split, per-stage loading) is ``models/decoder_stage.py``. Llama adds FP8 linears and ``compile=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...fp8 import convert_to_fp8
from ...layers import deferred_init, lm_head
from ..decoder_stage import DecoderStage, build_stage_list, criterion_for, local_stage_indices
from ..decoder_stage import stage_layer_ids as _split_layers
from .checkpoint import build_loaded, is_fp8_weight
from .config import LlamaConfig
from .model import LlamaBody, init_llama

__all__ = ["LlamaStage", "build_stages", "criterion_for", "stage_layer_ids", "stages_for_rank"]


def stage_layer_ids(config: LlamaConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Layers per stage: ``layout`` counts, or balanced (``decoder_stage.stage_layer_ids``)."""
    return _split_layers(config.num_hidden_layers, num_stages, layout)


class LlamaStage(DecoderStage):
    def __init__(self, config: LlamaConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True) -> None:
        super().__init__(config, index, num_stages)
        with deferred_init():
            self.model = LlamaBody(config, list(layer_ids), embed=self.holds_embedding, norm=self.is_last)
            if self.is_last and not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_llama(self, config.initializer_range)
        self.finish_init(defer_weight_grads)

    fp8_checkpoint_names = staticmethod(is_fp8_weight)


def build_stages(config: LlamaConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: torch.nn.Module | None = None, indices: Sequence[int] | None = None,
                 checkpoint: Any = None, dtype: torch.dtype | None = None, fp8: bool = False,
                 defer_weight_grads: bool = True, recompute: str = "none",
                 compile: bool | str = False) -> list[LlamaStage]:
    """The stage modules (all, or ``indices``): weights from ``source``, or read per stage from a Hugging
    Face ``checkpoint`` (only the stage's own tensors), or freshly initialised; in ``dtype`` (default: the
    default dtype). ``fp8`` converts the
    linears to ``FP8Linear`` (before loading, so FP8 checkpoint weights stay as stored). ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``models/recompute.py``). ``compile``: True
    (inductor) or a backend name compiles each layer's memory-bound parts, linears kept out of the
    graph (``models/compile.py``)."""
    ids = stage_layer_ids(config, num_stages, layout)

    def make(i: int) -> LlamaStage:
        return LlamaStage(config, i, num_stages, ids[i], defer_weight_grads)

    return build_stage_list(make, range(num_stages) if indices is None else indices, source=source,
                            checkpoint=checkpoint,
                            load=lambda factory, ckpt: build_loaded(factory, ckpt, dtype=dtype, fp8=fp8), dtype=dtype,
                            prepare=convert_to_fp8 if fp8 else None, recompute=recompute, compile=compile)


def stages_for_rank(config: LlamaConfig, schedule: Any, rank: int, layout: Sequence[int] | None = None,
                    **kwargs: Any) -> list[LlamaStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects); mirrored chains (DualPipe) map chain c's stage s to model stage s. ``kwargs`` go to
    ``build_stages`` (``source``, ``checkpoint``, ``dtype``, ``fp8``, ``defer_weight_grads``, ``recompute``,
    ``compile``)."""
    num, wanted = local_stage_indices(schedule, rank)
    return build_stages(config, num, layout, indices=wanted, **kwargs)
