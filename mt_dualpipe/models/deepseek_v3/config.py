"""DeepSeek-V3 hyper-parameters, with the released 671B configuration and a CPU-sized preset.

One frozen dataclass carries every size the model, the pipeline split and the losses need, so a
stage built on one rank and the reference model built in a test agree by construction.
``from_hf`` / ``to_hf`` translate the Hugging Face ``config.json`` (the released checkpoint's own
format, see ``hf_config.py``): a checkpoint is described by its config, not by a preset name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...layers.balance import PRIORITIES, strategy_overrides
from ...layers.rope import RopeSpec
from ...layers.savers import SaverSwitches
from .hf_config import config_kwargs_from_hf, config_to_hf, read_config_json
from .yarn import YarnScaling

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
CORE_ATTENTION = ("eager", "flash")
"""MLA's core attention (``DeepSeekV3Config.core_attention``): ``eager`` (einsum, softmax, einsum: autograd
keeps the S×S probabilities, or only q, k, v with the ``attention`` saver) or ``flash``
(``layers.flash_core``: q, k, v, the output and one log-sum-exp per head, what the planner counts as
``fused`` attention, its default)."""

_YARN_671B = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0)

_PRESETS: dict[str, dict[str, Any]] = {
    # The released deepseek-ai/DeepSeek-V3 config.json (tests/models hold its values); the
    # training-objective weights and init std stay at the technical report's §4.2 values.
    "671b": dict(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
        n_heads=128, n_routed_experts=256, n_shared_experts=1, n_activated_experts=8, n_expert_groups=8,
        n_limited_groups=4, route_scale=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mtp_depth=1, max_seq_len=163840, rope_scaling=_YARN_671B,
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
class DeepSeekV3Config(SaverSwitches):
    """Sizes of DeepSeek-V3 (defaults: the 671B model) plus the training-objective weights.

    ``mtp_loss_weight`` is λ, ``balance_loss_weight`` is α of the sequence-wise balance loss and
    ``bias_update_speed`` is γ of the auxiliary-loss-free balancing (report §2.1.2, §2.2, §4.2).
    Routing: ``scoring_func`` sigmoid (V3) or softmax (V2); ``topk_method`` ``noaux_tc`` (groups
    scored by their two best bias-corrected affinities, V3), ``group_limited_greedy`` (groups scored
    by their best affinity, no bias, V2) or ``greedy`` (plain top-k); ``norm_topk_prob`` normalises
    the chosen weights to sum 1 before ``route_scale``. ``rope_interleave``: RoPE rotates consecutive
    pairs (the released layout) rather than the two halves. ``hf_extra`` keeps the Hugging Face
    fields that do not shape the model (token ids, dtype, ...) so ``to_hf`` gives them back.

    Expert balancing (formulas in ``layers/balance.py``; ``with_balance(name)`` picks a named
    strategy): ``batch_balance_loss_weight`` is α of the batch-wise (Switch/GShard) loss over the EP
    ranks' batch; ``device_limit`` M > 0 confines each token to M of ``device_groups`` contiguous
    expert devices (replacing group-limited routing); ``capacity_factor`` > 0 drops the pairs beyond
    ``ceil(cf·T·K/N)`` per expert in ``capacity_priority`` order (0: no dropping, V3's default).
    ``fp8_dispatch``: the dispatch all-to-all carries E4M3 rows with 1×128 tile scales (the combine and
    every gradient stay in the model's dtype), as DeepSeek-V3 does to halve the dispatch bytes.
    ``memory_savers``: the report's activation savers that are on (``MEMORY_SAVERS``; a string such as
    ``"all"`` or ``"norm,swiglu"`` is accepted); off by default, so the modules save what eager autograd does.
    ``core_attention``: ``"eager"`` or ``"flash"`` (``CORE_ATTENTION``).
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
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    batch_balance_loss_weight: float = 0.0
    device_groups: int = 1
    device_limit: int = 0
    capacity_factor: float = 0.0
    capacity_priority: str = "position"
    fp8_dispatch: bool = False
    memory_savers: frozenset[str] = frozenset()
    core_attention: str = "eager"
    pad_token_id: int | None = None  # the embedding's padding_idx: that row gets no gradient (transformers')
    hf_extra: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        self.check_savers()
        positive = ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                    "n_activated_experts", "n_expert_groups", "n_limited_groups", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"DeepSeekV3Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"DeepSeekV3Config.pad_token_id {self.pad_token_id} is outside the vocabulary "
                             f"0..{self.vocab_size - 1}")
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "mtp_depth"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeepSeekV3Config.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers ({self.n_dense_layers}) must be <= n_layers ({self.n_layers})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported; choose one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported; choose one of {TOPK_METHODS}")
        if self.core_attention not in CORE_ATTENTION:
            raise ValueError(f"core_attention {self.core_attention!r} is not supported; choose one of "
                             f"{CORE_ATTENTION}")
        self._check_routing()
        self._check_balancing()

    def _check_balancing(self) -> None:
        if self.batch_balance_loss_weight < 0 or self.balance_loss_weight < 0 or self.bias_update_speed < 0:
            raise ValueError("balance_loss_weight, batch_balance_loss_weight and bias_update_speed must be >= 0")
        if self.capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0: no dropping), got {self.capacity_factor}")
        if self.capacity_priority not in PRIORITIES:
            raise ValueError(f"capacity_priority {self.capacity_priority!r} is not supported; choose one of "
                             f"{PRIORITIES}")
        if self.device_limit == 0:
            return
        if self.device_groups < 1 or self.n_routed_experts % self.device_groups:
            raise ValueError(f"device_groups ({self.device_groups}) must divide n_routed_experts "
                             f"({self.n_routed_experts})")
        if not 1 <= self.device_limit <= self.device_groups:
            raise ValueError(f"device_limit must be in 0..device_groups ({self.device_groups}), "
                             f"got {self.device_limit}")
        per_device = self.n_routed_experts // self.device_groups
        if self.device_limit * per_device < self.n_activated_experts or \
                per_device < math.ceil(self.n_activated_experts / self.device_limit):
            raise ValueError(f"device_limit {self.device_limit} x {per_device} experts per device cannot hold "
                             f"n_activated_experts ({self.n_activated_experts})")

    def with_balance(self, name: str) -> DeepSeekV3Config:
        """This config with the expert-balancing strategy ``name`` (``balancing.STRATEGIES``)."""
        return replace(self, **strategy_overrides(name))

    def _check_routing(self) -> None:
        if self.n_routed_experts % self.n_expert_groups:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by "
                             f"n_expert_groups ({self.n_expert_groups})")
        if not 1 <= self.n_limited_groups <= self.n_expert_groups:
            raise ValueError(f"n_limited_groups must be in 1..n_expert_groups ({self.n_expert_groups}), "
                             f"got {self.n_limited_groups}")
        if self.topk_method == "greedy":
            if self.n_activated_experts > self.n_routed_experts:
                raise ValueError(f"n_activated_experts ({self.n_activated_experts}) must be <= n_routed_experts "
                                 f"({self.n_routed_experts})")
            return
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_activated_experts > self.n_limited_groups * per_group:
            raise ValueError(f"n_activated_experts ({self.n_activated_experts}) must be <= the experts in the "
                             f"selected groups ({self.n_limited_groups} x {per_group})")
        if self.topk_method == "noaux_tc" and self.n_expert_groups > 1 and per_group < 2:
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

    @property
    def rope_spec(self) -> RopeSpec:
        """The rotary embedding as the shared layer's ``RopeSpec``: plain, or YaRN with every field of
        ``rope_scaling`` (the same frequencies and cos/sin factor)."""
        if self.rope_scaling is None:
            return RopeSpec(self.rope_theta)
        yarn = {k: v for k, v in asdict(self.rope_scaling).items() if v is not None}
        return RopeSpec(self.rope_theta, "yarn", tuple(sorted(yarn.items())))

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale² when the rope is scaled."""
        scale = self.qk_head_dim ** -0.5
        return scale * self.rope_scaling.softmax_factor() if self.rope_scaling is not None else scale

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DeepSeekV3Config:
        """``"671b"`` (the released model) or ``"tiny"`` (CPU-sized); keyword overrides win."""
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

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any], **overrides: Any) -> DeepSeekV3Config:
        """From a Hugging Face ``config.json`` (a dict, the file, or the checkpoint folder holding it).

        Every field that shapes the model is read; a value this implementation cannot run (another
        activation, GQA, attention bias, tied embeddings, an unknown rope type, ...) or a field it does
        not know raises ``ValueError`` naming it. ``overrides`` set training-only fields
        (``mtp_loss_weight``, ...) or replace read ones.
        """
        data = read_config_json(source) if not isinstance(source, dict) else source
        kwargs = config_kwargs_from_hf(data)
        return cls(**{**kwargs, **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (model_type ``deepseek_v3``) describing this model."""
        return config_to_hf(self)

    def replace(self, **changes: Any) -> DeepSeekV3Config:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready: the memory savers as a sorted list)."""
        out = asdict(self)
        out["memory_savers"] = sorted(self.memory_savers)
        return out
