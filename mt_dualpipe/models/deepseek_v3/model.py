"""The whole DeepSeek-V3 model in one module: the single-process reference the pipeline must match.

Stages (``stages.py``) are built from the same ``Block`` / ``MTPModule`` classes and copy weights
from this model by state-dict key, so a stage's parameter names are a subset of these.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ...layers.common import Elements, deferred_init
from ...layers.documents import check_document_labels, check_position_ids, document_ids
from ...layers.head import lm_loss, step_normalizer
from ...layers.moe import MoEBlock
from ...layers.router import Router
from ..hf_checkpoint import DEFAULT_SHARD_BYTES
from .checkpoint import build_loaded, hf_state_dict, open_checkpoint, save_weights
from .config import DeepSeekV3Config
from .mla import MLA, RMSNorm
from .moe import mlp, moe_block


class Block(nn.Module):
    """Pre-norm transformer block: MLA attention, then a dense SwiGLU FFN or DeepSeekMoE."""

    def __init__(self, layer_id: int, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        norm = config.saves("norm")
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps, norm)
        self.self_attn = MLA(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps, norm)
        self.mlp = moe_block(config, ep_group) if config.is_moe_layer(layer_id) else \
            mlp(config.dim, config.inter_dim, config.saves("swiglu"))

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoEBlock)

    def attention(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # "selective" recomputes MLA.attend (mla.py) in backward; position_ids: packed documents
        return x + self.self_attn(self.input_layernorm(x), position_ids)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        """``(module, method, tag)`` recomputed under ``policy`` (``models.recompute``): "selective"
        MLA from its latents; "full" the whole dense block, or a MoE block's attention sublayer and each
        expert (never the router or the dispatch/combine all-to-alls)."""
        if policy == "selective":
            yield self.self_attn, "attend", "latent_attention"
        elif policy == "full" and not isinstance(self.mlp, MoEBlock):
            yield self, "forward", "block"
        elif policy == "full":
            yield self, "attention", "attention"
            for expert in self.mlp.experts.values():
                yield expert, "forward", "expert"
            if self.mlp.shared_experts is not None:
                yield self.mlp.shared_experts, "forward", "shared_expert"

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention(x, position_ids)
        return x + self.mlp(self.post_attention_layernorm(x))

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """What the block keeps per token (activation-dtype elements), its modules' declarations put together
        along ``recompute_regions``: "full" keeps a dense block's input, or a MoE block's attention sublayer's
        input with the FFN norm, the routing, dispatch and combine and the experts' inputs; otherwise the two
        norms, MLA and the FFN, the MoE told whether its norm keeps only its input (the ``"router"`` saver then
        rebuilds the router's input from it)."""
        h = self.input_layernorm.weight.numel()
        if policy == "full" and not self.is_moe:
            return {"input": h}
        norm_recomputed = self.post_attention_layernorm.recompute
        if policy == "full":
            mlp = self.mlp.saved_per_token(policy, seq, norm_recomputed=norm_recomputed, experts_recomputed=True)
            post = sum(self.post_attention_layernorm.saved_per_token("none", seq).values())
            return {"attention_input": h, "post_attention_layernorm": post,
                    **{f"mlp.{n}": v for n, v in mlp.items()}}
        mlp = self.mlp.saved_per_token(policy, seq, norm_recomputed=norm_recomputed) if self.is_moe \
            else self.mlp.saved_per_token(policy, seq)
        parts = {"input_layernorm": self.input_layernorm, "self_attn": self.self_attn,
                 "post_attention_layernorm": self.post_attention_layernorm}
        kept = {name: sum(m.saved_per_token(policy, seq).values()) for name, m in parts.items()}
        return {**kept, **{f"mlp.{n}": v for n, v in mlp.items()}}


class SharedHead(nn.Module):
    """An MTP depth's ``shared_head``: its own input norm; the head itself is the main model's ``lm_head``."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.norm = norm


class MTPModule(nn.Module):
    """One multi-token-prediction depth: h'_i = W[RMSNorm(Emb(t_{i+k})); RMSNorm(h_i)] -> one block.

    The released convention (the checkpoint's ``eh_proj``, transformers' ``MtpLayer``, vLLM,
    Megatron): the *embedding* half comes first in the concatenation, and ``h`` is the previous
    depth's output *after* its final norm (the main model's ``norm(h)`` for depth 1, this module's
    ``shared_head.norm`` output for the next depth) — the same tensor the shared output head sees. The
    embedding and output head are the main model's (passed in, not owned); only the two norms, the
    projection ``eh_proj``, the block and the head's input norm ``shared_head.norm`` belong to this module.
    Names are the checkpoint's but for the prefix: ``mtp.{k-1}.`` is ``model.layers.{n_layers + k - 1}.``
    and the block's tensors sit under ``block.`` (``hf_names``).
    """

    def __init__(self, depth: int, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        norm = config.saves("norm")
        self.hnorm = RMSNorm(config.dim, config.norm_eps, norm)
        self.enorm = RMSNorm(config.dim, config.norm_eps, norm)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = Block(config.n_layers + depth - 1, config, ep_group)
        self.shared_head = SharedHead(RMSNorm(config.dim, config.norm_eps, norm))

    def forward(self, h: torch.Tensor, emb: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)), position_ids)

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """This depth's own tensors per token (activation-dtype elements) and its block's: the two input norms
        (the hidden half's input is the previous head's norm output, kept by that head already), the
        projection's input and the output norm (the shared head and the loss are ``head_saved_per_token``'s)."""
        e = Elements(self.eh_proj)
        hnorm = self.hnorm.saved_per_token(policy, seq)
        return {"enorm": sum(self.enorm.saved_per_token(policy, seq).values()),
                "hnorm": sum(v for n, v in hnorm.items() if n != "input"),
                "proj_input": e.linear_input(self.eh_proj, 2 * self.eh_proj.out_features),
                "norm": sum(self.shared_head.norm.saved_per_token(policy, seq).values()),
                **{f"block.{n}": v for n, v in self.block.saved_per_token(policy, seq).items()}}


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, keep_logits: bool = False,
                  normalizer: float | None = None) -> torch.Tensor:
    """Next-token loss in ``compute_dtype`` (mean, or sum over ``normalizer``), -100 targets masked;
    ``keep_logits``: the ``"loss"`` saver (``layers.head.lm_loss``)."""
    return lm_loss(logits, target, normalizer=normalizer, keep_logits=keep_logits)


def mtp_targets(labels: torch.Tensor, k: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """What MTP depth k predicts at positions 0..T-k-1: ``labels[:, k:]`` (token i + k + 1), and for packed rows
    (``position_ids``, ``layers.documents``) -100 wherever that token lies in another document than position
    i: a document's last k positions predict nothing at depth k, as when the document runs alone."""
    target = labels[:, k:]
    if position_ids is None or k == 0:
        return target
    docs = document_ids(position_ids)
    return target.masked_fill(docs[:, :target.size(1)] != docs[:, k:], -100)


def step_normalizers(labels: torch.Tensor | Sequence[torch.Tensor], mtp_depth: int,
                     group: dist.ProcessGroup | None = None, replicas: int = 1,
                     position_ids: torch.Tensor | Sequence[torch.Tensor] | None = None) -> tuple[float, ...]:
    """The valid-target counts that make a step's micro-batch losses sum to its token means: the main
    loss's (every label) and each MTP depth k's (``mtp_targets``: ``labels[:, k:]``, for packed rows
    ``position_ids`` without the targets in another document), over the step's ``labels`` (a tensor, or one
    per micro-batch with ``position_ids`` likewise) and ``group``'s; ``replicas`` as in
    ``layers.step_normalizer``."""
    many = not isinstance(labels, torch.Tensor)
    rows = list(labels) if many else [labels]
    pos = [None] * len(rows) if position_ids is None else (list(position_ids) if many else [position_ids])
    if len(pos) != len(rows):
        raise ValueError(f"step_normalizers got {len(rows)} label tensors but {len(pos)} position_ids tensors; give "
                         "one per micro-batch")
    return tuple(step_normalizer(torch.cat([mtp_targets(y, k, p).flatten() for y, p in zip(rows, pos)]), group=group,
                                 replicas=replicas) for k in range(mtp_depth + 1))


class LossParts(NamedTuple):
    total: torch.Tensor  # main + λ/D · Σ_k mtp_k  (the balance loss enters through its gradient)
    main: torch.Tensor
    mtp: list[torch.Tensor]


def language_model_losses(h: torch.Tensor, labels: torch.Tensor, *, embed: nn.Embedding, norm: nn.Module,
                          head: nn.Linear, mtp: nn.ModuleList, config: DeepSeekV3Config,
                          normalizer: Sequence[float] | None = None,
                          position_ids: torch.Tensor | None = None) -> LossParts:
    """Next-token loss on h plus the MTP losses; ``labels[:, i]`` is token i+1.

    ``normalizer`` None: each loss is the mean over this call's targets. Otherwise one count per loss
    (main, then depth 1..D: ``step_normalizers``), each loss the sum over its count, so the
    micro-batches of a step add up to the step's token means (masked targets spread unevenly).

    Depth k sees positions 0..T-k-1: it combines h^{k-1}_i with Emb(t_{i+k}) = Emb(labels[:, i+k-1])
    and predicts t_{i+k+1} = labels[:, i+k]. h^0 is the main model's normed output ``norm(h)`` and
    h^k the normed output of depth k (see ``MTPModule``).

    Packed rows (``position_ids``, ``layers.documents``): the labels must not cross a document (a
    document's last label -100, ``layers.check_document_labels``); each MTP block attends inside each
    document, and depth k's targets that lie in the next document are masked (``mtp_targets``), so
    every document gets the losses it would get alone. The positions a document's own targets never
    reach (its last k at depth k) embed whatever follows; they are masked and only later positions of
    the same document, masked too, attend to them.
    """
    seq = labels.size(1)
    if len(mtp) >= seq:
        raise ValueError(f"sequence length {seq} must exceed the MTP depth {len(mtp)}")
    keep = config.saves("loss")
    if normalizer is not None and len(normalizer) != len(mtp) + 1:
        raise ValueError(f"normalizer needs {len(mtp) + 1} counts (main loss and {len(mtp)} MTP depths: "
                         f"step_normalizers(labels, {len(mtp)})), got {len(normalizer)}")
    counts = list(normalizer) if normalizer is not None else [None] * (len(mtp) + 1)
    # MTP embeds the next tokens, which the last stage knows only as labels; a masked (-100) label's token
    # is unknown here and is embedded as token 0 (its own loss is masked; only the prediction right
    # after it sees the stand-in)
    tokens = labels.clamp(min=0) if mtp else labels
    if position_ids is not None:
        check_document_labels(labels, position_ids)
    prev = norm(h)
    logits = head(prev)
    main = cross_entropy(logits.flatten(0, 1), labels.flatten(), keep, counts[0])
    mtp_losses = []
    for k, module in enumerate(mtp, start=1):
        n = seq - k
        pos = None if position_ids is None else position_ids[:, :n]
        prev = module.shared_head.norm(module(prev[:, :n], embed(tokens[:, k - 1:k - 1 + n]), pos))
        logits_k = head(prev)
        target = mtp_targets(labels, k, position_ids)
        mtp_losses.append(cross_entropy(logits_k.flatten(0, 1), target.flatten(), keep, counts[k]))
    total = main
    if mtp_losses:
        total = main + config.mtp_loss_weight / len(mtp_losses) * torch.stack(mtp_losses).sum()
    return LossParts(total, main, mtp_losses)


def head_saved_per_token(hidden: int, vocab: int, keep_logits: bool, itemsize: int) -> dict[str, float]:
    """What the head and one cross-entropy keep per token, in elements of an ``itemsize``-byte activation dtype:
    the head's input (never FP8), the float32 log-probabilities (the model-dtype logits with the ``"loss"``
    saver, ``keep_logits``) and the target id; the final norm before it is an ``RMSNorm``'s to declare."""
    compute = 8 if itemsize == 8 else 4
    return {"head_input": hidden, "log_probs": vocab if keep_logits else vocab * compute / itemsize,
            "target": 8 / itemsize}


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for every projection, embedding and gate (report §4.2), an embedding's padding row zero
    (transformers'); norms stay at one."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, Router)) and not m.weight.is_meta:  # meta: shapes only
            nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()


class DeepSeekV3Decoder(nn.Module):
    """The checkpoint's ``model.``: ``embed_tokens``, ``layers`` (a ModuleDict by global layer id) and the final
    ``norm``; a pipeline stage holds the parts it runs (``embed``: the embedding, ``norm``: the final norm,
    ``norm_recompute``: its ``"norm"`` saver)."""

    def __init__(self, config: DeepSeekV3Config, layer_ids: Sequence[int], ep_group: dist.ProcessGroup | None = None,
                 *, embed: bool = True, norm: bool = True, norm_recompute: bool = False) -> None:
        super().__init__()
        if embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, config.pad_token_id)
        self.layers = nn.ModuleDict({str(i): Block(i, config, ep_group) for i in layer_ids})
        if norm:
            self.norm = RMSNorm(config.dim, config.norm_eps, norm_recompute)


def mtp_modules(config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> nn.ModuleList:
    """The MTP depths 1..``mtp_depth`` (``MTPModule``), the extra the last stage holds besides the head."""
    return nn.ModuleList(MTPModule(k, config, ep_group) for k in range(1, config.mtp_depth + 1))


class DeepSeekV3Model(nn.Module):
    """``model`` (embedding, ``n_layers`` blocks, the first ``n_dense_layers`` dense, final norm), ``lm_head``
    and the MTP depths ``mtp``: the checkpoint's names (``DeepseekV3ForCausalLM``) but for MTP's (``hf_names``)."""

    def __init__(self, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        with deferred_init():
            self.model = DeepSeekV3Decoder(config, range(config.n_layers), ep_group,
                                           norm_recompute=config.saves("norm"))
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
            self.mtp = mtp_modules(config, ep_group)
        init_weights(self, config.init_std)

    def hidden(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            check_position_ids(position_ids, tokens.shape, "DeepSeekV3Model")
        h = self.model.embed_tokens(tokens)
        for block in self.model.layers.values():
            h = block(h, position_ids)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) without labels; the training loss (main + MTP) with them.
        ``position_ids`` (batch, seq): packed documents, each beginning where the ids restart
        (``language_model_losses``)."""
        h = self.hidden(tokens, position_ids)
        if labels is None:
            return self.lm_head(self.model.norm(h))
        return self.losses(h, labels, position_ids=position_ids).total

    def losses(self, h: torch.Tensor, labels: torch.Tensor, normalizer: Sequence[float] | None = None,
               position_ids: torch.Tensor | None = None) -> LossParts:
        return language_model_losses(h, labels, embed=self.model.embed_tokens, norm=self.model.norm, head=self.lm_head,
                                     mtp=self.mtp, config=self.config, normalizer=normalizer, position_ids=position_ids)

    def mtp_logits(self, tokens: torch.Tensor, next_tokens: torch.Tensor,
                   position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Logits of each MTP depth k for positions 0..T-k-1, given ``next_tokens[:, i] = t_{i+1}``
        (inference-style; the training losses use the same chain)."""
        prev = self.model.norm(self.hidden(tokens, position_ids))
        out = []
        for k, module in enumerate(self.mtp, start=1):
            n = tokens.size(1) - k
            pos = None if position_ids is None else position_ids[:, :n]
            emb = self.model.embed_tokens(next_tokens[:, k - 1:k - 1 + n])
            prev = module.shared_head.norm(module(prev[:, :n], emb, pos))
            out.append(self.lm_head(prev))
        return out

    # ----- Hugging Face checkpoints -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = torch.float32,
                        device: torch.device | str = "cpu", ep_group: dist.ProcessGroup | None = None,
                        fp8: bool = False, **overrides: Any) -> DeepSeekV3Model:
        """A model from a Hugging Face checkpoint folder (``config.json``, safetensors shards and index):
        bf16, fp32 or FP8 (``weight_scale_inv``, dequantised to ``dtype``). ``overrides`` replace config
        fields (e.g. ``mtp_depth=0`` for a transformers-saved checkpoint without the MTP layer). With
        ``ep_group`` only this rank's experts are read. ``fp8``: the linears become ``FP8Linear`` (as
        ``convert_to_fp8``) and an FP8 checkpoint's E4M3 weights and scales are used as stored."""
        ckpt = open_checkpoint(path)
        config = DeepSeekV3Config.from_hf(ckpt.config(), **overrides)
        return build_loaded(lambda: cls(config, ep_group), ckpt, config, dtype=dtype, device=device, fp8=fp8)

    def save_pretrained(self, path: str | os.PathLike, *, dtype: torch.dtype | None = None, fp8: bool = False,
                        max_shard_size: int | None = None) -> Path:
        """Write the Hugging Face layout: ``config.json``, ``model-0000i-of-0000N.safetensors`` shards of at
        most ``max_shard_size`` bytes (default 2 GiB) and ``model.safetensors.index.json``, with the
        official tensor names (the MTP module as layer ``n_layers``). ``dtype`` casts (the router stays
        float32); ``fp8`` stores the projections as E4M3 with 128×128 block ``weight_scale_inv``."""
        return save_weights(self, self.config, path, dtype=dtype, fp8=fp8,
                            max_shard_size=max_shard_size or DEFAULT_SHARD_BYTES)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under their checkpoint names (what ``save_pretrained`` writes, before any cast)."""
        return hf_state_dict(self, self.config)

    def num_parameters(self, part: str = "main") -> int:
        """``"main"``: everything but the MTP modules; ``"mtp"``: the MTP modules' own parameters."""
        if part not in ("main", "mtp"):
            raise ValueError(f"part must be 'main' or 'mtp', got {part!r}")
        mtp = sum(p.numel() for p in self.mtp.parameters())
        return mtp if part == "mtp" else sum(p.numel() for p in self.parameters()) - mtp


def expert_load_names(config: DeepSeekV3Config) -> list[str]:
    """The routed-token count buffer (``mlp.gate.load``) of every MoE layer of the full model, main blocks then
    MTP blocks: the names every stage shares with ``DeepSeekV3Model``, so ranks holding different stages
    can lay their counts out in one agreed order (``stages.sync_expert_load``)."""
    names = [f"model.layers.{i}.mlp.gate.load" for i in range(config.n_layers) if config.is_moe_layer(i)]
    names += [f"mtp.{k - 1}.block.mlp.gate.load" for k in range(1, config.mtp_depth + 1)
              if config.is_moe_layer(config.n_layers + k - 1)]
    return names
