"""Qwen3-MoE (``Qwen3MoeForCausalLM`` in transformers): GQA with per-head q/k RMSNorm, softmax top-k MoE.

Composed only of ``mt_dualpipe.layers``. Module names are transformers' (``model.layers.3.mlp.experts.7.up_proj``,
``model.layers.3.mlp.gate.weight``), so a state-dict key is the checkpoint name and the loader needs
no mapping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...layers import (
    GQAttention,
    MoEBlock,
    RMSNorm,
    SoftmaxTopKRouter,
    SwiGLUMLP,
    check_document_labels,
    check_position_ids,
    deferred_init,
    embedding,
    init_normal,
    lm_head,
    lm_loss,
    logits,
)
from .checkpoint import build_loaded, open_checkpoint, save_weights
from .config import Qwen3MoeConfig


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, index: int, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        c = config
        self.index = index
        norm, swiglu = c.saves("norm"), c.saves("swiglu")
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, norm)
        self.self_attn = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope,
                                     qk_norm=True, eps=c.rms_norm_eps, norm_recompute=norm,
                                     core="recomputed" if c.saves("attention") else "eager")
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, norm)
        if c.is_moe_layer(index):
            router = SoftmaxTopKRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
            self.mlp: nn.Module = MoEBlock(c.hidden_size, c.moe_intermediate_size, router, ep_group=ep_group,
                                           balance_coef=c.balance_coef, recompute_product=swiglu,
                                           weight_before_down=c.saves("combine"))
        else:
            self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, recompute_product=swiglu)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attend(x, position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attend(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The attention sublayer with its residual (``position_ids``: packed documents, ``layers.documents``)."""
        return x + self.self_attn(self.input_layernorm(x), position_ids)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``"full"``: the whole layer (it keeps only its input), except that with expert parallelism the
        dispatch/combine all-to-alls are never re-run (ranks recompute at different times): the attention
        sublayer and each local expert instead. ``"selective"`` is declared by the attention (core) and
        each SwiGLU (dense or expert) themselves."""
        if policy != "full":
            return
        if isinstance(self.mlp, MoEBlock) and self.mlp.dispatcher.communicates:
            yield self, "attend", "attention_sublayer"
            for expert in self.mlp.experts.values():
                yield expert, "forward", "expert"
        else:
            yield self, "forward", "layer"


class Qwen3MoeBody(nn.Module):
    """transformers' ``Qwen3MoeModel`` part (``model.*``): embedding, some layers, maybe the final norm."""

    def __init__(self, config: Qwen3MoeConfig, layer_ids: range | list[int], embed: bool, norm: bool,
                 ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleDict({str(i): Qwen3MoeDecoderLayer(config, i, ep_group) for i in layer_ids})
        if norm:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.saves("norm"))


def init_qwen3_moe(module: nn.Module, std: float) -> None:
    init_normal(module, std)
    for m in module.modules():
        if isinstance(m, SoftmaxTopKRouter) and not m.weight.is_meta:
            nn.init.normal_(m.weight, 0.0, std)


class Qwen3MoeForCausalLM(nn.Module):
    """The whole model: ``model`` (embedding, layers, norm) and ``lm_head`` (absent when tied). With
    ``ep_group`` each MoE layer holds only this rank's experts (``layers.expert_parallel``)."""

    def __init__(self, config: Qwen3MoeConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        with deferred_init():
            self.model = Qwen3MoeBody(config, range(config.num_hidden_layers), embed=True, norm=True, ep_group=ep_group)
            if not config.tie_word_embeddings:
                self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        init_qwen3_moe(self, config.initializer_range)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) without labels; with them the mean next-token loss, plus (training with
        ``output_router_logits``) the MoE layers' balance losses, whose gradients the layers inject
        themselves (``layers.balance.AuxLoss``): here they are added as values only. ``position_ids``
        (batch, seq): packed documents, each beginning where the ids restart (``layers.documents``; the label of a
        document's last token must then be -100)."""
        if position_ids is not None:
            check_position_ids(position_ids, tokens.shape, "Qwen3MoeForCausalLM")
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers.values():
            h = layer(h, position_ids)
        out = logits(self.model.norm(h), self.head_weight())
        if labels is None:
            return out
        if position_ids is not None:
            check_document_labels(labels, position_ids)
        loss = lm_loss(out, labels, keep_logits=self.config.saves("loss"))
        if self.training and torch.is_grad_enabled() and self.config.balance_coef > 0:
            loss = loss + sum(m.last_balance_loss for m in self.modules() if isinstance(m, MoEBlock))
        return loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
                        device: torch.device | str = "cpu", ep_group: dist.ProcessGroup | None = None,
                        **overrides: Any) -> Qwen3MoeForCausalLM:
        """A model from a Hugging Face Qwen3-MoE checkpoint (every tensor read once, nothing initialised);
        with ``ep_group`` only this rank's experts are read."""
        ckpt = open_checkpoint(path)
        config = Qwen3MoeConfig.from_hf(ckpt.config(), **overrides)
        return build_loaded(lambda: cls(config, ep_group), ckpt, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        max_shard_size: int | None = None) -> Path:
        """config.json, safetensors shards and index with transformers' names (no ``lm_head`` when tied)."""
        return save_weights(self, path, dtype=dtype, max_shard_size=max_shard_size)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())
