"""What transformers' ``XModel.forward`` and ``XForCausalLM.forward`` do around the modules, done per stage.

A transformers body builds, once per forward, what each decoder layer takes besides the hidden states: position
ids, the rotary (cos, sin) and the causal mask of the layer's attention type; the causal-LM class then applies
the head and its logit transform. A pipeline stage holds only some layers and receives only hidden states, so
``LayerInputs`` rebuilds those arguments from them on every stage, with transformers' own mask functions
(``create_causal_mask``, ``create_sliding_window_causal_mask``) and the model's own rotary module, and
``embed`` / ``head_logits`` apply the scalings the classes apply outside their modules (Granite's
``embedding_multiplier``; Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``; Gemma's embedding scale lives in its embedding module). ``AdaptedCausalLM`` runs the whole
model through the same functions, which is how it is checked against transformers' own forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .support import layer_types


class LayerInputs:
    """The keyword arguments of layers ``layer_ids`` of a model with transformers config ``config``, rebuilt from
    the hidden states: positions 0..S-1, rotary embeddings from ``rotary`` (None: the layers have no RoPE, or
    compute it themselves) and one causal mask per attention type the layers use."""

    def __init__(self, config: Any, layer_ids: Iterable[int], rotary: nn.Module | None) -> None:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        types = layer_types(config)
        self.config = config
        self.types = {int(i): types[int(i)] for i in layer_ids}
        self.rotary = rotary
        self.rotary_per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.mask_functions = {"full_attention": create_causal_mask,
                               "sliding_attention": create_sliding_window_causal_mask}

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict[int, dict[str, Any]]:
        """Per layer id, what its forward takes besides ``hidden`` (batch, seq, hidden). ``position_ids`` (packed
        documents, ``layers.documents``): the rotary positions, and transformers' masks then keep attention
        inside each document (they start a new one where the ids do not count up by one)."""
        positions = (torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0) if position_ids is None
                     else position_ids.long())
        used = sorted(set(self.types.values()))
        # the first four arguments positionally: their names have changed between transformers releases
        masks = {t: self.mask_functions[t](self.config, hidden, None, None, position_ids=positions) for t in used}
        rotary: dict[str, Any] = {t: None for t in used}
        if self.rotary is not None and self.rotary_per_type:
            rotary = {t: self.rotary(hidden, positions, t) for t in used}
        elif self.rotary is not None and used:
            shared = self.rotary(hidden, positions)
            rotary = {t: shared for t in used}
        return {i: {"attention_mask": masks[t], "position_embeddings": rotary[t], "position_ids": positions}
                for i, t in self.types.items()}


@functools.cache
def _accepted(layer_class: type) -> frozenset[str] | None:
    """The keyword arguments a layer class's forward takes, None when it takes any (``**kwargs``)."""
    params = inspect.signature(layer_class.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def call_layer(layer: nn.Module, hidden: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """``layer(hidden, **inputs)`` with the arguments its forward takes; its hidden states (a tuple's first)."""
    accepted = _accepted(type(layer))
    if accepted is not None:
        inputs = {k: v for k, v in inputs.items() if k in accepted}
    out = layer(hidden, **inputs)
    return out[0] if isinstance(out, tuple) else out


def run_layers(layers: Iterable[tuple[int, nn.Module]], layer_inputs: LayerInputs, hidden: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
    layers = list(layers)
    if not layers:
        return hidden
    inputs = layer_inputs(hidden, position_ids)
    for i, layer in layers:
        hidden = call_layer(layer, hidden, inputs[i])
    return hidden


def embed(embed_tokens: nn.Module, config: Any, ids: torch.Tensor) -> torch.Tensor:
    """The token embedding as the body applies it (Granite multiplies it by ``embedding_multiplier``)."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"the first stage takes token ids (int64), got a {ids.dtype} tensor")
    h = embed_tokens(ids)
    multiplier = getattr(config, "embedding_multiplier", None)
    return h * multiplier if multiplier not in (None, 1, 1.0) else h


def head_logits(config: Any, hidden: torch.Tensor, head: nn.Module | None, tied_weight: torch.Tensor | None
                ) -> torch.Tensor:
    """Logits of the normed ``hidden``: the ``head`` module, or the tied embedding matrix, then the causal-LM
    class's transform (Gemma's softcap, Cohere's ``logit_scale``, Granite's ``logits_scaling``)."""
    logits = head(hidden) if head is not None else F.linear(hidden, tied_weight)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    scale = getattr(config, "logit_scale", None)
    if scale is not None:
        logits = logits * scale
    divisor = getattr(config, "logits_scaling", None)
    if divisor is not None:
        logits = logits / divisor
    return logits
