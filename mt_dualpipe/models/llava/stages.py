"""LLaVA cut into pipeline stages for any placement (linear, V, dual, interleaved).

The stages cut the text decoder; everything before it lives on the first stage: the vision tower, the
projector and the token embedding, so the first stage takes ``(input_ids, pixel_values)`` (both split
along dim 0 into micro-batches, the layout of ``inputs.py``) and hands on the merged sequence as any
activation, (batch, seq, hidden). The last stage holds the final norm and the head (with tied
embeddings its own copy of ``embed_tokens``, declared in ``tied_parameters``) and ``criterion``.
Names are the full model's (transformers 5's), so ``build_stages(..., checkpoint=path)`` reads exactly a
stage's tensors, whatever layout the checkpoint uses.

``layout``: text layers per stage; None splits them evenly (extra layers on the middle-to-late stages),
``"balanced"`` weighs the vision encoder's cost on the first stage (``balance.balanced_layout``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...integrations.recompute import apply_recompute, check_policy
from ...layers import deferred_init, lm_head, lm_loss, logits
from ...runtime.deferred import defer_weight_grads as _defer_weight_grads
from .balance import balanced_layout
from .checkpoint import build_loaded, open_checkpoint
from .config import LlavaConfig
from .model import LlavaBody, embed_inputs, init_llava


def stage_layer_ids(config: LlavaConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Text layers per stage: ``layout`` counts, or even with the extra layers on the middle-to-late stages."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    n = config.num_hidden_layers
    if layout is None:
        base, extra = divmod(n, num_stages)
        counts = [base + (1 if num_stages - 1 - extra <= i < num_stages - 1 else 0) for i in range(num_stages)]
    else:
        counts = [int(c) for c in layout]
    if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != n:
        raise ValueError(f"layout {counts} must give {num_stages} non-negative layer counts summing to "
                         f"the text model's num_hidden_layers = {n}")
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


class LlavaStage(nn.Module):
    def __init__(self, config: LlavaConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.config, self.index, self.num_stages = config, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.loss_log: list[float] = []
        tied = config.tie_word_embeddings
        embed = self.is_first or (self.is_last and tied)
        with deferred_init():
            self.model = LlavaBody(config, list(layer_ids), vision=self.is_first, embed=embed, norm=self.is_last)
            if self.is_last and not tied:
                self.lm_head = lm_head(config.text.hidden_size, config.text.vocab_size)
        init_llava(self, config)
        both = tied and num_stages > 1 and embed
        self.tied_parameters: tuple[str, ...] = ("model.language_model.embed_tokens.weight",) if both else ()
        if defer_weight_grads:
            _defer_weight_grads(self)

    def extra_repr(self) -> str:
        parts = ["vision tower, projector, embedding"] if self.is_first else []
        parts.append(f"text layers {list(self.model.language_model.layers)}")
        return f"stage {self.index} of {self.num_stages}: " + ", ".join(parts)

    def forward(self, x: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: ``(input_ids, pixel_values)`` -> merged hidden states; others: hidden -> hidden."""
        if self.is_first:
            x = embed_inputs(self.model, self.config, x, pixel_values)
        elif pixel_values is not None:
            raise ValueError(f"{self.extra_repr()} is not the first stage: only the first takes pixel_values")
        return self.model.language_model.run_layers(x)

    def criterion(self, h: torch.Tensor, labels: torch.Tensor,
                  normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's next-token loss (``-100`` targets, image tokens and padding, masked): its mean, or
        with ``normalizer`` (``layers.step_normalizer`` of the step's labels) its sum over the step's
        valid-target count, so micro-batches holding different numbers of masked targets add up to the
        step's token mean."""
        if not self.is_last:
            raise RuntimeError(f"{self.extra_repr()} is not the last stage: it has no head or loss")
        lm = self.model.language_model
        weight = lm.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        loss = lm_loss(logits(lm.norm(h), weight), labels, normalizer=normalizer)
        self.loss_log.append(float(loss.detach()))
        return loss

    @torch.no_grad()
    def load_from(self, model: nn.Module) -> LlavaStage:
        src, own = model.state_dict(), self.state_dict()
        missing = [k for k in own if k not in src]
        if missing:
            raise ValueError(f"the source model lacks {len(missing)} of this stage's keys, e.g. {missing[:3]}")
        self.load_state_dict({k: src[k] for k in own})
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def build_stages(config: LlavaConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None, checkpoint: Any = None,
                 dtype: torch.dtype | None = None, defer_weight_grads: bool = True,
                 recompute: str = "none") -> list[LlavaStage]:
    """The stage modules (all, or ``indices``): weights copied from ``source``, read per stage from a
    Hugging Face ``checkpoint`` (only the stage's own tensors), or freshly initialised. ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``integrations/recompute.py``; the vision layers too)."""
    check_policy(recompute)
    if source is not None and checkpoint is not None:
        raise ValueError("give build_stages either source= (a model to copy) or checkpoint=, not both")
    ids = stage_layer_ids(config, num_stages, layout)
    wanted = range(num_stages) if indices is None else indices

    def make(i: int) -> LlavaStage:
        return LlavaStage(config, i, num_stages, ids[i], defer_weight_grads)

    if checkpoint is not None:
        ckpt = open_checkpoint(checkpoint)
        stages = [build_loaded(lambda i=i: make(i), ckpt, dtype=dtype) for i in wanted]
    else:
        stages = [make(i) for i in wanted]
        for st in stages:
            if dtype is not None:
                st.to(dtype)
            if source is not None:
                st.load_from(source)
    for st in stages:
        apply_recompute(st, recompute)
    return stages


def stages_for_rank(config: LlavaConfig, schedule: Any, rank: int, layout: Sequence[int] | str | None = None, *,
                    seq_len: int | None = None, images_per_sample: float = 1.0, **kwargs: Any) -> list[LlavaStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects). ``layout="balanced"``: text layers per stage balanced by modelled cost with the vision encoder
    (``images_per_sample`` images, sequences of ``seq_len``) on the first stage; ``kwargs`` go to
    ``build_stages``."""
    num = schedule.num_stages(0) if callable(schedule.num_stages) else schedule.num_stages
    if layout == "balanced":
        layout = balanced_layout(config, schedule.placement, seq_len=seq_len, images_per_sample=images_per_sample)
    elif isinstance(layout, str):
        raise ValueError(f"layout must be layer counts, None or 'balanced', got {layout!r}")
    wanted = [s for _, s in schedule.local_stages(rank)]
    return build_stages(config, num, layout, indices=wanted, **kwargs)


def criterion_for(stages: Sequence[LlavaStage], normalizer: float | torch.Tensor | None = None
                  ) -> Callable[..., torch.Tensor] | None:
    """The bound criterion of the last stage among this rank's stages, or None; with ``normalizer`` (the
    step's valid-target count, ``layers.step_normalizer``) bound to it."""
    last = [st for st in stages if st.is_last]
    if not last:
        return None
    return last[0].criterion if normalizer is None else functools.partial(last[0].criterion, normalizer=normalizer)
