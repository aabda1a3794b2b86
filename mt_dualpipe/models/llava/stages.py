"""LLaVA cut into pipeline stages for any placement (linear, V, dual, interleaved).

The stages cut the text decoder; everything before it lives on the first stage: the vision tower, the
projector and the token embedding, so the first stage takes ``(input_ids, pixel_values)`` (both split
along dim 0 into micro-batches, the layout of ``inputs.py``) and hands on the merged sequence as any
activation, (batch, seq, hidden). The last stage holds the final norm and the head (with tied
embeddings its own copy of ``embed_tokens``, declared in ``tied_parameters``) and ``criterion``.
Names are the full model's (transformers 5's), so ``build_stages(..., checkpoint=path)`` reads exactly a
stage's tensors, whatever layout the checkpoint uses. Packed documents (``layers/documents.py``): the
first stage takes ``(input_ids, pixel_values, position_ids)`` (the position ids of the merged sequence,
one per token, image tokens included) and every stage hands on ``(hidden, position_ids)``, as
``models/decoder_stage.py`` describes.

``layout``: text layers per stage; None splits them evenly (extra layers on the middle-to-late stages),
``"balanced"`` weighs the vision encoder's cost on the first stage (``balance.balanced_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...layers import check_position_ids, deferred_init, hand_on, lm_head
from ..decoder_stage import DecoderStage, build_stage_list, criterion_for, local_stage_indices
from ..decoder_stage import stage_layer_ids as _split_layers
from .balance import balanced_layout
from .checkpoint import build_loaded
from .config import LlavaConfig
from .model import LlavaBody, embed_inputs, init_llava

__all__ = ["LlavaStage", "build_stages", "criterion_for", "stage_layer_ids", "stages_for_rank"]


def stage_layer_ids(config: LlavaConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Text layers per stage: ``layout`` counts, or even with the extra layers on the middle-to-late stages."""
    return _split_layers(config.num_hidden_layers, num_stages, layout, what="the text model's num_hidden_layers")


class LlavaStage(DecoderStage):
    embedding_name = "model.language_model.embed_tokens.weight"

    def __init__(self, config: LlavaConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True) -> None:
        super().__init__(config, index, num_stages)
        with deferred_init():
            self.model = LlavaBody(config, list(layer_ids), vision=self.is_first, embed=self.holds_embedding,
                                   norm=self.is_last)
            if self.is_last and not config.tie_word_embeddings:
                self.lm_head = lm_head(config.text.hidden_size, config.text.vocab_size)
        init_llava(self, config)
        self.finish_init(defer_weight_grads)

    @property
    def decoder(self) -> nn.Module:
        return self.model.language_model

    def extra_repr(self) -> str:
        parts = ["vision tower, projector, embedding"] if self.is_first else []
        parts.append(f"text layers {list(self.decoder.layers)}")
        return f"stage {self.index} of {self.num_stages}: " + ", ".join(parts)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor | None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """First stage: ``(input_ids[, pixel_values][, position_ids])`` -> merged hidden states; others: hidden ->
        hidden. Packed documents (``layers.documents``): the position ids (integers; pixel values are floats,
        which tells the two apart) follow, a later stage takes ``(hidden, position_ids)``, and every stage then
        returns ``(hidden, position_ids)``."""
        pixel_values, position_ids, wrong = self.split_inputs(extra)
        if wrong:
            takes = "(input_ids[, pixel_values][, position_ids])" if self.is_first else (
                "(hidden[, position_ids]): only the first stage takes pixel_values")
            got = ", ".join("None" if t is None else f"a {t.dtype} tensor" for t in extra)
            raise ValueError(f"{self.extra_repr()} takes {takes}; after its first input it got {got}")
        h = embed_inputs(self.model, self.config, x, pixel_values) if self.is_first else x
        if position_ids is None:
            return self.run_layers(h)
        check_position_ids(position_ids, x.shape[:2], self.extra_repr())
        return self.run_layers(h, position_ids), hand_on(position_ids)

    def split_inputs(self, extra: Sequence[torch.Tensor | None]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
        """The inputs after the first -> (pixel values, position ids, whether anything was left over): pixel
        values (a float tensor or None) on the first stage only, then position ids (integers)."""
        rest = list(extra)
        pixel_values = position_ids = None
        if self.is_first and rest and (rest[0] is None or rest[0].is_floating_point()):
            pixel_values = rest.pop(0)
        if rest and rest[0] is not None and not rest[0].is_floating_point():
            position_ids = rest.pop(0)
        return pixel_values, position_ids, bool(rest)


def build_stages(config: LlavaConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None, checkpoint: Any = None,
                 dtype: torch.dtype | None = None, defer_weight_grads: bool = True,
                 recompute: str = "none", compile: bool | str = False) -> list[LlavaStage]:
    """The stage modules (all, or ``indices``): weights copied from ``source``, read per stage from a
    Hugging Face ``checkpoint`` (only the stage's own tensors), or freshly initialised. ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``models/recompute.py``; the vision layers too).
    ``compile``: True (inductor) or a backend name compiles each text layer's memory-bound parts
    (``DecoderStage.compile_targets``; the vision tower stays eager: its image count changes per micro-batch)."""
    ids = stage_layer_ids(config, num_stages, layout)

    def make(i: int) -> LlavaStage:
        return LlavaStage(config, i, num_stages, ids[i], defer_weight_grads)

    return build_stage_list(make, range(num_stages) if indices is None else indices, source=source,
                            checkpoint=checkpoint,
                            load=lambda factory, ckpt: build_loaded(factory, ckpt, dtype=dtype), dtype=dtype,
                            recompute=recompute, compile=compile)


def stages_for_rank(config: LlavaConfig, schedule: Any, rank: int, layout: Sequence[int] | str | None = None, *,
                    seq_len: int | None = None, images_per_sample: float = 1.0, **kwargs: Any) -> list[LlavaStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects). ``layout="balanced"``: text layers per stage balanced by modelled cost with the vision encoder
    (``images_per_sample`` images, sequences of ``seq_len``) on the first stage; ``kwargs`` go to
    ``build_stages``."""
    if layout == "balanced":
        layout = balanced_layout(config, schedule.placement, seq_len=seq_len, images_per_sample=images_per_sample)
    elif isinstance(layout, str):
        raise ValueError(f"layout must be layer counts, None or 'balanced', got {layout!r}")
    num, wanted = local_stage_indices(schedule, rank)
    return build_stages(config, num, layout, indices=wanted, **kwargs)
