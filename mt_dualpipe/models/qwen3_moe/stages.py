"""Qwen3-MoE cut into pipeline stages for any placement (linear, V, dual, interleaved).

A stage holds a contiguous run of decoder layers; the first also the embedding, the last the final norm
and the head (with tied embeddings its own copy of ``model.embed_tokens``, declared in
``tied_parameters`` so a ``Pipeline`` sums the copies' gradients). Names are the full model's (= the
checkpoint's), so ``build_stages(..., checkpoint=path)`` reads exactly a stage's tensors. Contract as
for the other families: ``stage(x)`` -> hidden states, the last stage's ``criterion(hidden, labels)``
-> mean next-token loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...integrations.recompute import apply_recompute, check_policy
from ...layers import deferred_init, lm_head, lm_loss, logits
from ...runtime.deferred import defer_weight_grads as _defer_weight_grads
from .checkpoint import build_loaded, open_checkpoint
from .config import Qwen3MoeConfig
from .model import Qwen3MoeBody, init_qwen3_moe


def stage_layer_ids(config: Qwen3MoeConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
    """Layers per stage: ``layout`` counts, or balanced with the extra layers on the middle-to-late stages
    (the first stage carries the embedding, the last the head)."""
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
                         f"num_hidden_layers = {n}")
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


class Qwen3MoeStage(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.config, self.index, self.num_stages = config, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.loss_log: list[float] = []
        embed = self.is_first or (self.is_last and config.tie_word_embeddings)
        with deferred_init():
            self.model = Qwen3MoeBody(config, list(layer_ids), embed=embed, norm=self.is_last, ep_group=ep_group)
            if self.is_last and not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_qwen3_moe(self, config.initializer_range)
        tied = config.tie_word_embeddings and num_stages > 1 and embed
        self.tied_parameters: tuple[str, ...] = ("model.embed_tokens.weight",) if tied else ()
        if defer_weight_grads:
            _defer_weight_grads(self)

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}, layers {list(self.model.layers)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"the first stage takes token ids (int64), got a {x.dtype} tensor")
            x = self.model.embed_tokens(x)
        for layer in self.model.layers.values():
            x = layer(x)
        return x

    def criterion(self, h: torch.Tensor, labels: torch.Tensor,
                  normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
        """The micro-batch's next-token loss: its mean, or with ``normalizer`` (``layers.step_normalizer``)
        its sum over the step's valid-target count, so the micro-batches add up to the step's token mean."""
        if not self.is_last:
            raise RuntimeError(f"{self.extra_repr()} is not the last stage: it has no head or loss")
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        loss = lm_loss(logits(self.model.norm(h), weight), labels, ignore_index=-100, normalizer=normalizer)
        self.loss_log.append(float(loss.detach()))
        return loss

    @torch.no_grad()
    def load_from(self, model: nn.Module) -> Qwen3MoeStage:
        src, own = model.state_dict(), self.state_dict()
        missing = [k for k in own if k not in src]
        if missing:
            raise ValueError(f"the source model lacks {len(missing)} of this stage's keys, e.g. {missing[:3]}")
        self.load_state_dict({k: src[k] for k in own})
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def build_stages(config: Qwen3MoeConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None, checkpoint: Any = None,
                 dtype: torch.dtype | None = None, defer_weight_grads: bool = True,
                 recompute: str = "none", ep_group: dist.ProcessGroup | None = None) -> list[Qwen3MoeStage]:
    """The stage modules (all, or ``indices``): weights copied from ``source``, read per stage from a
    Hugging Face ``checkpoint`` (only the stage's own tensors), or freshly initialised. ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``integrations/recompute.py``). ``ep_group``: each MoE layer
    holds (and reads) only this rank's experts."""
    check_policy(recompute)
    if source is not None and checkpoint is not None:
        raise ValueError("give build_stages either source= (a model to copy) or checkpoint=, not both")
    ids = stage_layer_ids(config, num_stages, layout)
    wanted = range(num_stages) if indices is None else indices

    def make(i: int) -> Qwen3MoeStage:
        return Qwen3MoeStage(config, i, num_stages, ids[i], defer_weight_grads, ep_group)

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


def stages_for_rank(config: Qwen3MoeConfig, schedule: Any, rank: int, layout: Sequence[int] | None = None,
                    **kwargs: Any) -> list[Qwen3MoeStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects); ``kwargs`` go to ``build_stages``."""
    num = schedule.num_stages(0) if callable(schedule.num_stages) else schedule.num_stages
    wanted = [s for _, s in schedule.local_stages(rank)]
    return build_stages(config, num, layout, indices=wanted, **kwargs)


def criterion_for(stages: Sequence[Qwen3MoeStage], normalizer: float | torch.Tensor | None = None
                  ) -> Callable[..., torch.Tensor] | None:
    """The bound criterion of the last stage among this rank's stages, or None; with ``normalizer`` (the
    step's valid-target count, ``layers.step_normalizer``) bound to it."""
    last = [st for st in stages if st.is_last]
    if not last:
        return None
    return last[0].criterion if normalizer is None else functools.partial(last[0].criterion, normalizer=normalizer)
