"""What every decoder family's pipeline stage has in common, written once.

A family's stage (``LlamaStage``, ``Qwen3MoeStage``, ``LlavaStage``) is a ``DecoderStage``: a contiguous
run of decoder layers, the first stage also the embedding (and whatever the family puts before the
decoder, e.g. LLaVA's vision tower), the last the final norm and the head (with tied embeddings its own
copy of the embedding, declared in ``tied_parameters`` so a ``Pipeline`` sums the copies' gradients).
Parameter names are the full model's (= the checkpoint's), so a stage's state dict is a subset of the
model's and per-stage loading reads exactly the stage's tensors.

The family supplies only what differs: how its body is built (``__init__``), where the decoder lives
(``decoder``: ``self.model`` or LLaVA's ``self.model.language_model``) and, for LLaVA, what the first
stage takes. Everything a schedule needs is here: the layer split (``stage_layer_ids``), the contract
``stage(x)`` -> hidden states and ``criterion(hidden, labels, normalizer=None)`` -> loss (for packed
documents ``stage(x, position_ids)`` -> ``(hidden, position_ids)`` and ``criterion(hidden, position_ids,
labels)``: below), weight copying
(``load_from``), the stage list for a rank (``local_stage_indices``, ``build_stage_list``), what
``compile=`` compiles (``compile_targets``, applied with the recompute policy by ``stage_finisher``) and the
bound criterion (``criterion_for``). DeepSeek-V3's stages (``models/deepseek_v3/stages.py``) keep their
own class: their MTP module and overlapped forward/backward do not fit this contract.

Packed documents (``layers/documents.py``): the first stage takes ``(ids, position_ids)`` and every
stage passes the position ids on with its hidden states, ``(hidden, position_ids)``, the last stage
included, so its criterion is called ``criterion(hidden, position_ids, labels)`` (the runtime's
``criterion(*outputs, *labels)``). The ids travel as an int32 copy (``hand_on``): a criterion called
with them but without labels says so instead of reading them as labels (labels are int64). Each
layer derives the documents (a new one wherever the ids restart) and the RoPE angles from them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..layers import MoEBlock, lm_loss, logits
from ..layers.documents import check_document_labels, check_position_ids, criterion_inputs, hand_on
from ..runtime.deferred import defer_weight_grads as _defer_weight_grads
from .compile import check_backend, compile_stage
from .hf_checkpoint import open_checkpoint
from .recompute import apply_recompute, check_policy, stage_policy


def stage_layer_ids(num_layers: int, num_stages: int, layout: Sequence[int] | None = None,
                    what: str = "num_hidden_layers") -> list[list[int]]:
    """Layers per stage: ``layout`` counts, or balanced with the extra layers on the middle-to-late stages
    (the first stage carries the embedding, the last the head). ``what`` names the count in errors."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if layout is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if num_stages - 1 - extra <= i < num_stages - 1 else 0) for i in range(num_stages)]
    else:
        counts = [int(c) for c in layout]
    if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != num_layers:
        raise ValueError(f"layout {counts} must give {num_stages} non-negative layer counts summing to "
                         f"{what} = {num_layers}")
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts)]


class DecoderStage(nn.Module):
    """Base of the families' stages. Subclasses call ``super().__init__(config, index, num_stages)``, build
    ``self.model`` (and ``self.lm_head`` on an untied last stage) and end with ``self.finish_init(...)``."""

    embedding_name = "model.embed_tokens.weight"  # the tied copy's FQN (LLaVA: under model.language_model)
    extras: tuple[str, ...] = ()  # modules the last stage holds besides the head (DeepSeek-V3: "mtp")

    def __init__(self, config: Any, index: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index {index} is outside 0..{num_stages - 1}")
        self.config, self.index, self.num_stages = config, index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.loss_log: list[float] = []
        self.loss_fn: Callable[..., torch.Tensor] = lm_loss  # compile= may swap in a compiled copy

    @property
    def last_reads_embedding(self) -> bool:
        """Whether the last stage reads the embedding too: a tied head (DeepSeek-V3: its MTP depths)."""
        return bool(self.config.tie_word_embeddings)

    @property
    def holds_embedding(self) -> bool:
        """The first stage embeds; where the last reads the embedding too it holds a copy."""
        return self.is_first or (self.is_last and self.last_reads_embedding)

    def finish_init(self, defer_weight_grads: bool) -> None:
        """Declare the tied embedding copy (a stage of a multi-stage chain holding it) and defer W."""
        tied = self.last_reads_embedding and self.num_stages > 1 and self.holds_embedding
        self.tied_parameters: tuple[str, ...] = (self.embedding_name,) if tied else ()
        if defer_weight_grads:
            _defer_weight_grads(self)

    @property
    def decoder(self) -> nn.Module:
        """The module holding ``embed_tokens``, ``layers`` (a ModuleDict by global id) and ``norm``."""
        return self.model

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}, layers {list(self.decoder.layers)}"

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"the first stage takes token ids (int64), got a {x.dtype} tensor")
        return self.decoder.embed_tokens(x)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.decoder.layers.values():
            h = layer(h, position_ids)
        return h

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (first stage) or hidden states -> hidden states; with ``position_ids`` (packed
        documents, ``layers.documents``) -> (hidden states, position ids), which the next stage takes."""
        h = self.embed(x) if self.is_first else x
        if position_ids is None:
            return self.run_layers(h)
        check_position_ids(position_ids, x.shape[:2], self.extra_repr())
        return self.run_layers(h, position_ids), hand_on(position_ids)

    def criterion(self, h: torch.Tensor, *rest: torch.Tensor,
                  normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
        """``criterion(h, labels)``, or for packed rows ``criterion(h, position_ids, labels)`` (what the last
        stage returned, then the labels): the micro-batch's next-token loss (``-100`` targets masked), its
        mean, or with ``normalizer`` (``layers.step_normalizer``: the step's valid-target count) its sum
        divided by it, so micro-batches holding different numbers of masked targets add up to the step's
        token mean. Packed rows' labels must not cross a document (``layers.check_document_labels``)."""
        if not self.is_last:
            raise RuntimeError(f"{self.extra_repr()} is not the last stage: it has no head or loss")
        position_ids, labels = criterion_inputs(rest, self.extra_repr())
        if position_ids is not None:
            check_document_labels(labels, position_ids)
        out = self.head_logits(h)
        keep = bool(getattr(self.config, "saves", lambda name: False)("loss"))  # the "loss" saver (layers.savers)
        if normalizer is None:
            loss = self.loss_fn(out, labels, ignore_index=-100, keep_logits=keep)
        else:  # the sum (normalizer 1.0, a constant: a compiled loss_fn does not recompile per step), then divided
            loss = self.loss_fn(out, labels, ignore_index=-100, normalizer=1.0, keep_logits=keep) / normalizer
        self.loss_log.append(float(loss.detach()))
        return loss

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's logits: the final norm, then the head (the embedding matrix when tied)."""
        weight = self.decoder.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return logits(self.decoder.norm(h), weight)

    @torch.no_grad()
    def load_from(self, model: nn.Module) -> DecoderStage:
        """Copy this stage's tensors from a full model with the same names."""
        src, own = model.state_dict(), self.state_dict()
        missing = [k for k in own if k not in src]
        if missing:
            raise ValueError(f"the source model lacks {len(missing)} of this stage's keys, e.g. {missing[:3]}")
        self.load_state_dict({k: src[k] for k in own})
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    def compile_targets(self) -> list[nn.Module]:
        """What ``compile=`` compiles (``models/compile.py``), the memory-bound parts: per decoder layer
        each sub-module (norms, attention with RoPE and softmax, the dense SwiGLU), of an MoE block only its
        shared experts (routed experts, router, dispatch and combine stay eager: their row counts follow the
        routing, and a compiled version would recompile with every count), and the final norm; the loss is
        compiled on its own (``loss_fn``). Linears inside stay out of the graphs' weight gradients, so their
        GEMMs still wait for W; the residual adds stay eager."""
        targets: list[nn.Module] = []
        for layer in self.decoder.layers.values():
            for child in layer.children():
                if isinstance(child, MoEBlock):
                    targets += [child.shared_experts] if child.shared_experts is not None else []
                else:
                    targets.append(child)
        if self.is_last:
            targets.append(self.decoder.norm)
        return targets


def stage_finisher(recompute: str, backend: str | None) -> Callable[[DecoderStage], None]:
    """What ``build_stage_list`` does last to each stage: the ``recompute`` policy, or with a compile
    ``backend`` the compilation of ``compile_targets`` (which must wrap the policy's regions) and of the
    last stage's loss (its float upcast and softmax fuse)."""
    def finish(stage: DecoderStage) -> None:
        if backend is None:
            apply_recompute(stage, stage_policy(stage, recompute))
            return
        compile_stage(stage, stage.compile_targets(), backend=backend, recompute=stage_policy(stage, recompute))
        if stage.is_last:
            stage.loss_fn = torch.compile(lm_loss, backend=backend)
    return finish


def local_stage_indices(schedule: Any, rank: int) -> tuple[int, list[int]]:
    """(stages in the model chain, this rank's model-stage indices in ``local_stages(rank)`` order, the
    order the runtime expects; mirrored chains (DualPipe) map chain c's stage s to model stage s)."""
    num = schedule.num_stages(0) if callable(schedule.num_stages) else schedule.num_stages
    return num, [s for _, s in schedule.local_stages(rank)]


def build_stage_list(make: Callable[[int], DecoderStage], wanted: Iterable[int], *, source: nn.Module | None,
                     checkpoint: Any, load: Callable[[Callable[[], DecoderStage], Any], DecoderStage],
                     dtype: torch.dtype | None = None, prepare: Callable[[DecoderStage], Any] | None = None,
                     recompute: str = "none", compile: bool | str = False) -> list[DecoderStage]:
    """The stages ``wanted``: read per stage from ``checkpoint`` (``load(factory, ckpt)``: only the stage's
    tensors), or built, cast to ``dtype``, copied from ``source`` and ``prepare``d (Llama's FP8 conversion,
    which a checkpoint load does itself), or freshly initialised; then ``stage_finisher``: the
    ``recompute`` policy, applied inside the compiled regions when ``compile`` names a backend (True:
    inductor). Both options are checked before any stage is built."""
    check_policy(recompute)
    finish = stage_finisher(recompute, check_backend(compile))
    if source is not None and checkpoint is not None:
        raise ValueError("give build_stages either source= (a model to copy) or checkpoint=, not both")
    if checkpoint is not None:
        ckpt = open_checkpoint(checkpoint)
        stages = [load(functools.partial(make, i), ckpt) for i in wanted]
    else:
        stages = [make(i) for i in wanted]
        for st in stages:
            if dtype is not None:
                st.to(dtype)
            if source is not None:
                st.load_from(source)
            if prepare is not None:
                prepare(st)
    for st in stages:
        finish(st)
    return stages


def criterion_for(stages: Sequence[nn.Module], normalizer: float | torch.Tensor | None = None
                  ) -> Callable[..., torch.Tensor] | None:
    """The bound criterion of the last stage among this rank's stages, or None; with ``normalizer`` (the
    step's valid-target count, ``layers.step_normalizer``) bound to it."""
    last = [st for st in stages if st.is_last]
    if not last:
        return None
    return last[0].criterion if normalizer is None else functools.partial(last[0].criterion, normalizer=normalizer)
