"""An adapted model cut into pipeline stages for any placement (linear, V, dual, interleaved).

An ``AdaptedStage`` is a ``DecoderStage`` (``models/decoder_stage.py``) whose modules are the transformers
model's own, deep-copied from a skeleton on the meta device (``checkpoint.skeleton``) under transformers' names:
the first stage ``model.embed_tokens`` (with its scaling, Gemma's is inside the module), every stage its
``model.layers.<i>`` and a copy of ``model.rotary_emb``, the last ``model.norm`` and ``lm_head`` (tied: its own
copy of ``model.embed_tokens``, declared in ``tied_parameters`` as every family's tied head is, so a ``Pipeline``
sums the copies' gradients). A stage rebuilds its layers' position ids, rotary embeddings and masks from the
hidden states it receives (``decoder.LayerInputs``); the loss is the library's ``lm_loss`` (``criterion``,
``criterion_for``, ``normalizer=``). Weights come from a source model, or per stage from a checkpoint (only the
stage's tensors, converted as transformers converts them: ``checkpoint.read_stage``), or fresh from the model's
own init.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..decoder_stage import DecoderStage, build_stage_list, criterion_for, local_stage_indices, stage_layer_ids
from ..hf_checkpoint import Checkpoint, build_on_meta
from .checkpoint import checkpoint_tensors, initialize, read_stage, skeleton
from .config import AdaptedConfig
from .decoder import LayerInputs, embed, head_logits, run_layers
from .support import AdapterError

__all__ = ["AdaptedStage", "build_stages", "criterion_for", "stages_for_rank"]


class AdaptedStage(DecoderStage):
    """Stage ``index`` of ``num_stages`` holding layers ``layer_ids`` of ``model`` (a transformers causal LM,
    usually the meta-device skeleton: its modules are copied, never shared)."""

    def __init__(self, config: AdaptedConfig, index: int, num_stages: int, layer_ids: Sequence[int], model: Any,
                 defer_weight_grads: bool = True) -> None:
        super().__init__(config, index, num_stages)
        body = model.model
        memo = {id(model.config): model.config}  # the copies share the model's config object
        self.model = nn.Module()
        if self.holds_embedding:
            self.model.embed_tokens = copy.deepcopy(body.embed_tokens, memo)
        self.model.layers = nn.ModuleDict({str(i): copy.deepcopy(body.layers[i], memo) for i in layer_ids})
        rotary = getattr(body, "rotary_emb", None)
        if layer_ids and rotary is not None:
            self.model.rotary_emb = copy.deepcopy(rotary, memo)
        if self.is_last:
            self.model.norm = copy.deepcopy(body.norm, memo)
            if not config.tie_word_embeddings:
                self.lm_head = copy.deepcopy(model.lm_head, memo)
        self.__dict__["transformers_model"] = model  # not a submodule: its conversions and init, never its weights
        self.layer_inputs = LayerInputs(model.config, layer_ids, getattr(self.model, "rotary_emb", None))
        self.finish_init(defer_weight_grads)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return embed(self.model.embed_tokens, self.layer_inputs.config, x)

    def run_layers(self, h: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return run_layers(((int(i), layer) for i, layer in self.model.layers.items()), self.layer_inputs, h,
                          position_ids)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        tied = self.config.tie_word_embeddings
        return head_logits(self.layer_inputs.config, self.model.norm(h), None if tied else self.lm_head,
                           self.model.embed_tokens.weight if tied else None)

    @torch.no_grad()
    def load_from(self, model: nn.Module) -> AdaptedStage:
        """Copy this stage's tensors, non-persistent buffers included (the rotary frequencies, Gemma's embedding
        scale), from a whole model with transformers' names (an ``AdaptedCausalLM`` or the transformers model)."""
        source = {**dict(model.named_buffers()), **model.state_dict()}
        own = {**dict(self.named_buffers()), **self.state_dict(keep_vars=True)}
        missing = [k for k in own if k not in source]
        if missing:
            raise ValueError(f"the source model lacks {len(missing)} of this stage's keys, e.g. {missing[:3]}")
        for key, tensor in own.items():
            tensor.copy_(source[key])
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors in the layout transformers writes (Mixtral's experts one tensor each)."""
        return checkpoint_tensors(self.transformers_model, dict(self.state_dict()))


def _check_options(recompute: str, compile: bool | str) -> None:
    if recompute != "none" or compile:
        raise AdapterError(f"recompute={recompute!r}, compile={compile!r}: an adapted transformers model runs its "
                           "own modules as they are (recompute='none', compile=False)")


def build_stages(config: AdaptedConfig, num_stages: int, layout: Sequence[int] | None = None, *,
                 source: nn.Module | None = None, indices: Sequence[int] | None = None, checkpoint: Any = None,
                 dtype: torch.dtype | None = None, defer_weight_grads: bool = True, recompute: str = "none",
                 compile: bool | str = False, attn_implementation: str | None = None,
                 experts_implementation: str | None = None) -> list[AdaptedStage]:
    """The stage modules (all, or ``indices``): weights copied from ``source`` (in its dtype unless ``dtype`` is
    given), read per stage from a Hugging Face ``checkpoint`` (only the stage's tensors; ``dtype`` default
    float32), or fresh from the model's own init. ``defer_weight_grads``: the linears become ``DeferredLinear``
    (their weight gradients wait for W). ``attn_implementation``, ``experts_implementation``: transformers' choice
    of kernels (default: the config's, as a source model was loaded, else transformers' default)."""
    _check_options(recompute, compile)
    if dtype is None:
        dtype = next(source.parameters()).dtype if source is not None else torch.float32
    ids = stage_layer_ids(config.num_hidden_layers, num_stages, layout)
    model = skeleton(config, attn_implementation=attn_implementation, experts_implementation=experts_implementation)

    def make(i: int, fresh: bool = True) -> AdaptedStage:
        stage = build_on_meta(lambda: AdaptedStage(config, i, num_stages, ids[i], model, defer_weight_grads),
                              dtype=dtype)
        initialize(stage, model, fresh=fresh and source is None)
        return stage

    def load(factory: Any, ckpt: Checkpoint) -> AdaptedStage:
        stage = factory(fresh=False)
        read_stage(stage, model, ckpt)
        return stage

    return build_stage_list(make, range(num_stages) if indices is None else indices, source=source,
                            checkpoint=checkpoint, load=load, dtype=dtype)


def stages_for_rank(config: AdaptedConfig, schedule: Any, rank: int, layout: Sequence[int] | None = None,
                    **kwargs: Any) -> list[AdaptedStage]:
    """This rank's stages for any schedule or placement, in ``local_stages(rank)`` order (what the runtime
    expects); ``kwargs`` go to ``build_stages``."""
    num, wanted = local_stage_indices(schedule, rank)
    return build_stages(config, num, layout, indices=wanted, **kwargs)
