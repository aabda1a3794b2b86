"""Llama cut into pipeline stages for any placement (linear, V, dual, interleaved).

A stage holds a contiguous run of decoder layers; the first also the embedding, the last the final
norm and the head (and, with tied embeddings, its own copy of ``model.embed_tokens``, whose gradient
``layers.replicas.sync_replicas`` sums with the first stage's, as it does for every replicated name).
Layers come from ``model.py`` (the shared ``mt_dualpipe.layers``); the loss is ``layers.lm_loss``.
Names are the full model's (= the checkpoint's), so ``build_stages(..., checkpoint=path)`` reads
exactly a stage's tensors. Contract as for DeepSeek-V3: ``stage(x)`` -> hidden states, the last
stage's ``criterion(hidden, labels, normalizer=None)`` -> the micro-batch's mean next-token loss, or its
sum over the step's valid-target count (``layers.step_normalizer``; bind it with ``criterion_for``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...integrations.compile import check_backend, compile_stage
from ...integrations.fp8 import convert_to_fp8
from ...integrations.recompute import apply_recompute, check_policy
from ...layers import deferred_init, lm_head, lm_loss, logits
from ...runtime.deferred import defer_weight_grads as _defer_weight_grads
from .checkpoint import build_loaded, is_fp8_weight, open_checkpoint
from .config import LlamaConfig
from .model import LlamaBody, init_llama


def stage_layer_ids(config: LlamaConfig, num_stages: int, layout: Sequence[int] | None = None) -> list[list[int]]:
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
        raise ValueError(f"layout {list(counts)} must give {num_stages} non-negative layer counts summing to "
                         f"num_hidden_layers = {n}")
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


class LlamaStage(nn.Module):
    def __init__(self, config: LlamaConfig, index: int, num_stages: int, layer_ids: Sequence[int],
                 defer_weight_grads: bool = True) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.config, self.index, self.num_stages = config, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.loss_log: list[float] = []
        self.loss_fn = lm_loss  # compile= swaps in a compiled copy (the float upcast and softmax of the logits fuse)
        embed = self.is_first or (self.is_last and config.tie_word_embeddings)
        with deferred_init():
            self.model = LlamaBody(config, list(layer_ids), embed=embed, norm=self.is_last)
            if self.is_last and not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_llama(self, config.initializer_range)
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
        out = logits(self.model.norm(h), weight)
        if normalizer is None:
            loss = self.loss_fn(out, labels, ignore_index=-100)
        else:  # the sum (normalizer 1.0, a constant: a compiled loss_fn does not recompile per step), then divided
            loss = self.loss_fn(out, labels, ignore_index=-100, normalizer=1.0) / normalizer
        self.loss_log.append(float(loss.detach()))
        return loss

    @torch.no_grad()
    def load_from(self, model: nn.Module) -> LlamaStage:
        src, own = model.state_dict(), self.state_dict()
        missing = [k for k in own if k not in src]
        if missing:
            raise ValueError(f"the source model lacks {len(missing)} of this stage's keys, e.g. {missing[:3]}")
        self.load_state_dict({k: src[k] for k in own})
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    fp8_checkpoint_names = staticmethod(is_fp8_weight)

    def compile_targets(self) -> list[nn.Module]:
        """What ``compile=`` compiles (``integrations/compile.py``): per layer its two norms, the attention
        (RoPE, GQA repeat, softmax) and the MLP (SwiGLU product), and the final norm (the loss is
        compiled on its own: ``loss_fn``); each module's linears stay eager so their weight GEMMs still
        wait for W. The residual adds stay eager."""
        targets: list[nn.Module] = []
        for layer in self.model.layers.values():
            targets += [layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp]
        if self.is_last:
            targets.append(self.model.norm)
        return targets


def _finish(stage: LlamaStage, recompute: str, backend: str | None) -> LlamaStage:
    """The recompute policy, and compilation when asked (which must wrap the policy's regions)."""
    if backend is None:
        apply_recompute(stage, recompute)
    else:
        compile_stage(stage, stage.compile_targets(), backend=backend, recompute=recompute)
        if stage.is_last:
            stage.loss_fn = torch.compile(lm_loss, backend=backend)
    return stage


def build_stages(config: LlamaConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None,
                 checkpoint: Any = None, fp8: bool = False, defer_weight_grads: bool = True,
                 recompute: str = "none", compile: bool | str = False) -> list[LlamaStage]:
    """The stage modules (all, or ``indices``): weights from ``source``, or read per stage from a Hugging
    Face ``checkpoint`` (only the stage's own tensors), or freshly initialised. ``fp8`` converts the
    linears to ``FP8Linear`` (before loading, so FP8 checkpoint weights stay as stored). ``recompute``:
    ``"none"``, ``"selective"`` or ``"full"`` (``integrations/recompute.py``). ``compile``: True
    (inductor) or a backend name compiles each layer's memory-bound parts, linears kept out of the
    graph (``integrations/compile.py``)."""
    check_policy(recompute)
    backend = check_backend(compile)
    if source is not None and checkpoint is not None:
        raise ValueError("give build_stages either source= (a model to copy) or checkpoint=, not both")
    ids = stage_layer_ids(config, num_stages, layout)
    wanted = range(num_stages) if indices is None else indices

    def make(i: int) -> LlamaStage:
        return LlamaStage(config, i, num_stages, ids[i], defer_weight_grads)

    if checkpoint is not None:
        ckpt = open_checkpoint(checkpoint)
        stages = [build_loaded(lambda i=i: make(i), ckpt, fp8=fp8) for i in wanted]
        return [_finish(st, recompute, backend) for st in stages]
    stages = [make(i) for i in wanted]
    for st in stages:
        if source is not None:
            st.load_from(source)
        if fp8:
            convert_to_fp8(st)
    return [_finish(st, recompute, backend) for st in stages]


def stages_for_rank(config: LlamaConfig, schedule: Any, rank: int, layout: Sequence[int] | None = None,
                    **kwargs: Any) -> list[LlamaStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects); mirrored chains (DualPipe) map chain c's stage s to model stage s. ``kwargs`` go to
    ``build_stages`` (``source``, ``checkpoint``, ``fp8``, ``defer_weight_grads``, ``recompute``,
    ``compile``)."""
    num = schedule.num_stages(0) if callable(schedule.num_stages) else schedule.num_stages
    wanted = [s for _, s in schedule.local_stages(rank)]
    return build_stages(config, num, layout, indices=wanted, **kwargs)


def criterion_for(stages: Sequence[LlamaStage], normalizer: float | torch.Tensor | None = None
                  ) -> Callable[..., torch.Tensor] | None:
    """The bound criterion of the last stage among this rank's stages, or None; with ``normalizer`` (the
    step's valid-target count, ``layers.step_normalizer``) bound to it."""
    last = [st for st in stages if st.is_last]
    if not last:
        return None
    return last[0].criterion if normalizer is None else functools.partial(last[0].criterion, normalizer=normalizer)
