"""DeepSeek-V3 hyper-parameters, with the published 671B configuration and a CPU-sized preset.

One frozen dataclass carries every size the model, the pipeline split and the losses need, so a
stage built on one rank and the reference model built in a test agree by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

_PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 technical report §4.2 and the released config_671B.json.
    "671b": dict(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
        n_heads=128, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, n_expert_groups=8,
        n_limited_groups=4, route_scale=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mtp_depth=1, max_seq_len=4096,
    ),
    # Trains on a laptop CPU in seconds; keeps every structural feature of the full model
    # (dense first layer, shared + routed experts, group-limited routing, MLA with LoRA ranks, MTP).
    "tiny": dict(
        vocab_size=1024, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=4, n_dense_layers=1,
        n_heads=4, n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, n_expert_groups=4,
        n_limited_groups=2, route_scale=2.5, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, mtp_depth=1, max_seq_len=256,
    ),
}


@dataclass(frozen=True)
class DeepSeekV3Config:
    """Sizes of DeepSeek-V3 (defaults: the 671B model) plus the training-objective weights.

    ``mtp_loss_weight`` is λ, ``balance_loss_weight`` is α of the sequence-wise balance loss and
    ``bias_update_speed`` is γ of the auxiliary-loss-free balancing (report §2.1.2, §2.2, §4.2).
    """

    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432
    moe_inter_dim: int = 2048
    n_layers: int = 61
    n_dense_layers: int = 3
    n_heads: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    route_scale: float = 2.5
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mtp_depth: int = 1
    mtp_loss_weight: float = 0.3
    balance_loss_weight: float = 1e-4
    bias_update_speed: float = 1e-3
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    init_std: float = 0.006

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                    "n_activated_experts", "n_expert_groups", "n_limited_groups", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSeekV3Config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "mtp_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeepSeekV3Config.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers ({self.n_dense_layers}) must be <= n_layers ({self.n_layers})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                             f"n_expert_groups ({self.n_expert_groups})")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be in 1..n_expert_groups ({self.n_expert_groups}), "
                             f"got {self.n_limited_groups}")
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_activated_experts > self.n_limited_groups * per_group:
            raise ValueError(f"n_activated_experts ({self.n_activated_experts}) must be <= the experts in the "
                             f"selected groups ({self.n_limited_groups} x {per_group})")
        if self.n_expert_groups > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its top-2 experts: each group needs >= 2")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        """Layers ``0..n_dense_layers-1`` are dense; later ones, MTP blocks included, are MoE."""
        return layer_id >= self.n_dense_layers

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DeepSeekV3Config:
        """``"671b"`` (the published model) or ``"tiny"`` (CPU-sized); keyword overrides win."""
        if name not in _PRESETS:
            raise ValueError(f"unknown DeepSeek-V3 preset {name!r}; choose one of {sorted(_PRESETS)}")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"unknown DeepSeekV3Config field(s) {bad}; fields are {sorted(known)}")
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

    def replace(self, **changes: Any) -> DeepSeekV3Config:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
