"""Qwen3-MoE's sizes, read from and written to a Hugging Face ``config.json`` (``model_type: qwen3_moe``).

A layer is sparse (an MoE block) when it is not in ``mlp_only_layers``, there are experts, and
``(layer + 1) % decoder_sparse_step == 0``; otherwise it has a dense SwiGLU of ``intermediate_size``.
Unsupported fields (attention bias, sliding window, another activation) are refused, not ignored.

``output_router_logits`` switches the load-balancing loss on, as in transformers: each MoE layer adds
``router_aux_loss_coef`` x its Switch loss / the number of MoE layers (``balance_coef``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ...layers.rope import RopeSpec
from ...layers.savers import SaverSwitches

MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class Qwen3MoeConfig(SaverSwitches):
    """``memory_savers``: the activation savers that are on (``layers.savers``; not a checkpoint field)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=lambda: RopeSpec(1_000_000.0))
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    pad_token_id: int | None = None  # the embedding's padding_idx: that row gets no gradient (transformers')
    memory_savers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.check_savers()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    @property
    def balance_coef(self) -> float:
        """Each MoE layer's weight on its balance loss: the coefficient averaged over the MoE layers (0 when
        ``output_router_logits`` is off, transformers' default)."""
        moe = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        return self.router_aux_loss_coef / moe if self.output_router_logits and moe else 0.0

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes: Any) -> Qwen3MoeConfig:
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen3MoeConfig:
        """``"30b-a3b"`` (Qwen3-30B-A3B) or ``"tiny"`` (tests)."""
        presets = {
            "30b-a3b": {},
            "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,),
                         rope=RopeSpec(10000.0), max_position_embeddings=256),
        }
        if name not in presets:
            raise ValueError(f"unknown Qwen3-MoE preset {name!r}; choose one of {sorted(presets)}")
        return cls(**{**presets[name], **overrides})

    # ----- Hugging Face -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict[str, Any], **overrides: Any) -> Qwen3MoeConfig:
        if data.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config model_type={data.get('model_type')!r} is not {MODEL_TYPE!r}")
        refused = {"attention_bias": (False, None), "hidden_act": ("silu", None),
                   "use_sliding_window": (False, None)}
        for key, fine in refused.items():
            if data.get(key) not in fine:
                raise ValueError(f"config field {key}={data.get(key)!r} is not supported for Qwen3-MoE")
        experts = data.get("num_experts", data.get("num_local_experts", 0))
        heads = int(data["num_attention_heads"])
        kwargs = dict(
            vocab_size=int(data["vocab_size"]), hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            moe_intermediate_size=int(data.get("moe_intermediate_size", 0)),
            num_hidden_layers=int(data["num_hidden_layers"]), num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
            num_experts=int(experts or 0), num_experts_per_tok=int(data.get("num_experts_per_tok", 1)),
            norm_topk_prob=bool(data.get("norm_topk_prob", False)),
            decoder_sparse_step=int(data.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in data.get("mlp_only_layers") or ()),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope=RopeSpec.from_hf(data),
            max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            initializer_range=float(data.get("initializer_range", 0.02)),
            router_aux_loss_coef=float(data.get("router_aux_loss_coef", 0.001)),
            output_router_logits=bool(data.get("output_router_logits", False)),
            pad_token_id=data.get("pad_token_id"),
        )
        return cls(**{**kwargs, **overrides})

    def to_hf(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("rope", "memory_savers")}
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        out.update(model_type=MODEL_TYPE, architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
                   attention_bias=False, use_sliding_window=False, rope_parameters=self.rope.to_hf())
        return out
