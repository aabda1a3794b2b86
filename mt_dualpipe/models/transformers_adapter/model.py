"""``AdaptedCausalLM``: a transformers decoder-only causal LM, run the way its pipeline stages run it.

``mt_dualpipe.from_pretrained`` returns one for any ``model_type`` without a native family that the adapter
takes (``support.check_adaptable``). Its submodules are the transformers model's own ``model`` and ``lm_head``
(so its state-dict keys are transformers' names, which the stages copy from), and its forward is the stages'
code end to end (``decoder``): the embedding, the layers with their rebuilt positions, rotary embeddings and
masks, the norm and the head with its logit transform, then the library's loss. ``from_pretrained`` checks that
forward against transformers' own on a short sequence (``check_against_transformers``), so a model whose body
does something the adapter does not rebuild is refused at load time rather than trained wrongly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...layers import lm_loss
from ..registry import read_config
from .checkpoint import checkpoint_tensors
from .config import AdaptedConfig
from .decoder import LayerInputs, embed, head_logits, run_layers
from .support import AdapterError, check_adaptable, require_transformers

CHECK_TOKENS = 16


class AdaptedCausalLM(nn.Module):
    """``lm``: a transformers causal LM the adapter takes (``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``, ...)."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        transformers = require_transformers()
        if not isinstance(lm, transformers.PreTrainedModel):
            raise TypeError(f"AdaptedCausalLM wraps a transformers model, got {type(lm).__name__}")
        check_adaptable(lm.config)
        if lm.base_model_prefix != "model" or not isinstance(getattr(lm, "lm_head", None), nn.Module):
            raise AdapterError(f"{type(lm).__name__} keeps its body under {lm.base_model_prefix!r}; the adapter takes "
                               "causal LMs with model.* and lm_head")
        self.config = AdaptedConfig(lm.config)
        self.model = lm.model
        self.lm_head = lm.lm_head
        self.__dict__["transformers_model"] = lm  # not registered again: its modules are this model's
        self.layer_inputs = LayerInputs(lm.config, range(self.config.num_hidden_layers),
                                        getattr(lm.model, "rotary_emb", None))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab); with ``labels`` (next tokens, -100 masked) the library's loss instead."""
        hf = self.transformers_model.config
        h = run_layers(enumerate(self.model.layers), self.layer_inputs, embed(self.model.embed_tokens, hf, tokens))
        tied = self.config.tie_word_embeddings
        out = head_logits(hf, self.model.norm(h), None if tied else self.lm_head,
                          self.model.embed_tokens.weight if tied else None)
        return out if labels is None else lm_loss(out, labels, normalizer=normalizer)

    @torch.no_grad()
    def check_against_transformers(self, tokens: torch.Tensor | None = None) -> float:
        """The largest logit difference between this forward and transformers' own, relative to the largest logit,
        on ``tokens`` (default: ``CHECK_TOKENS`` random ids); an ``AdapterError`` when it is beyond rounding."""
        if tokens is None:
            g = torch.Generator().manual_seed(0)
            length = min(CHECK_TOKENS, int(getattr(self.config.hf, "max_position_embeddings", CHECK_TOKENS)))
            tokens = torch.randint(0, self.config.vocab_size, (1, length), generator=g)
        tokens = tokens.to(self.model.embed_tokens.weight.device)
        training = self.transformers_model.training
        self.transformers_model.eval()  # no dropout: the two forwards must see the same function
        try:
            ours = self(tokens).float()
            theirs = self.transformers_model(tokens).logits.float()
        finally:
            self.transformers_model.train(training)
        scale = float(theirs.abs().max()) or 1.0
        diff = float((ours - theirs).abs().max()) / scale
        dtype = self.model.embed_tokens.weight.dtype
        tolerance = 1e-4 if dtype.itemsize >= 4 else 5e-2
        if not diff <= tolerance:
            raise AdapterError(f"the adapter's logits for {type(self.transformers_model).__name__} differ from "
                               f"transformers' own forward by {diff:.3g} (relative; rounding allows {tolerance}): "
                               "its body does something the adapter does not rebuild")
        return diff

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
                        device: torch.device | str = "cpu", check: bool = True, **kwargs: Any) -> AdaptedCausalLM:
        """The model of a Hugging Face folder, loaded by transformers (``kwargs`` go to its ``from_pretrained``,
        e.g. ``attn_implementation``); ``check``: compare with transformers' forward once (see the module doc)."""
        transformers = require_transformers()
        AdaptedConfig.from_hf(read_config(path))  # refuse before reading any weight
        lm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
        model = cls(lm)
        if check:
            model.check_against_transformers()
        return model

    def save_pretrained(self, path: str | os.PathLike, **kwargs: Any) -> Path:
        """transformers' ``save_pretrained`` (its checkpoint layout; ``kwargs`` go to it); returns the folder."""
        self.transformers_model.save_pretrained(path, **kwargs)
        return Path(path)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors in the layout transformers writes (Mixtral's experts one tensor each)."""
        return checkpoint_tensors(self.transformers_model, dict(self.transformers_model.state_dict()))
