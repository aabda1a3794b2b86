"""Rotary position embedding: plain, Llama-3 scaling and YaRN, read from a Hugging Face config.

``rope_params`` reads theta and the scaling from a config dict, ``supported_scaling`` also checks them
against what a family runs (the Llama and DeepSeek-V3 config readers);
``RopeSpec`` is the config piece (theta, scaling kind and its fields); ``inv_freq`` the per-pair
frequencies; ``cos_sin`` the (seq, dim/2) tables in ``compute_dtype`` (YaRN's ``attention_factor``
folded in), or per row (batch, seq, dim/2) for given position ids (packed documents restart at 0);
``apply_rope`` rotates the two halves of each head (transformers' ``rotate_half`` layout) or, with
``interleave``, adjacent pairs (the released DeepSeek-V3 layout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def rope_params(data: Mapping[str, Any]) -> tuple[float | None, str, dict[str, Any]]:
    """(rope_theta, scaling type, its other fields) from a Hugging Face config.

    Reads ``rope_scaling`` (the released configs) or ``rope_parameters`` (transformers 5); the type
    is ``"default"`` when there is no scaling. Each model checks the type and fields it supports.
    """
    params = data.get("rope_parameters") or data.get("rope_scaling")
    theta = data.get("rope_theta")
    if not params:
        return theta, "default", {}
    params = dict(params)
    theta = params.pop("rope_theta", theta)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return theta, kind, params


def supported_scaling(data: Mapping[str, Any], family: str, kind: str, keys: set[str]
                      ) -> tuple[float | None, dict[str, Any] | None]:
    """``rope_params`` checked against what one family runs: (rope_theta, the scaling's fields), the fields None
    without scaling; ``ValueError`` for another scaling type or a field outside ``keys``."""
    theta, got, params = rope_params(data)
    if got == "default":
        return theta, None
    if got != kind:
        raise ValueError(f"rope scaling type {got!r} is not supported for {family}; only {kind!r} (and none)")
    bad = sorted(set(params) - keys)
    if bad:
        raise ValueError(f"rope_scaling field(s) {bad} are not supported; {kind} takes {sorted(keys)}")
    return theta, params


KINDS = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    kind: str = "default"
    params: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rope scaling type {self.kind!r} is not supported; choose one of {KINDS}")
        need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings")}.get(self.kind, ())
        absent = [k for k in need if k not in self.param]
        if absent:
            raise ValueError(f"rope scaling {self.kind!r} needs {absent}")

    @property
    def param(self) -> dict[str, Any]:
        return dict(self.params)

    @classmethod
    def from_hf(cls, data: dict[str, Any], default_theta: float = 10000.0) -> RopeSpec:
        """From ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older configs)."""
        theta, kind, params = rope_params(data)
        if kind == "default":
            params = {}  # plain RoPE has no other field (configs sometimes carry unused ones)
        if kind == "yarn" and "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = data.get("max_position_embeddings")
        return cls(float(theta if theta is not None else default_theta), kind, tuple(sorted(params.items())))

    def to_hf(self) -> dict[str, Any]:
        """transformers 5's ``rope_parameters``."""
        return {"rope_theta": self.theta, "rope_type": self.kind, **self.param}

    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (YaRN's magnitude correction; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        p = self.param
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        factor, mscale, mscale_all = p["factor"], p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            return _mscale(factor, mscale) / _mscale(factor, mscale_all)
        return _mscale(factor)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(dim: int, spec: RopeSpec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``dim / 2`` rotary frequencies."""
    base = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype) / dim)
    inv = 1.0 / base
    p = spec.param
    if spec.kind == "llama3":
        # wavelengths longer than original/low_freq_factor slowed by ``factor``, shorter than
        # original/high_freq_factor kept, a smooth blend in between
        old, factor = p["original_max_position_embeddings"], p["factor"]
        lo, hi = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        slowed = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        middle = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(middle, blended, slowed)
    if spec.kind == "yarn":
        # pairs turning more than beta_fast times over the original context keep their frequency, fewer
        # than beta_slow are interpolated (θ/factor), a linear ramp over the pair index in between
        old, factor = p["original_max_position_embeddings"], p["factor"]
        fast, slow, truncate = p.get("beta_fast", 32.0), p.get("beta_slow", 1.0), p.get("truncate", True)

        def pair(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

        low, high = pair(fast), pair(slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        return inv / factor * ramp + inv * (1 - ramp)
    return inv


def cos_sin(seq: int, dim: int, spec: RopeSpec, dtype: torch.dtype, device: torch.device | str = "cpu",
            positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles for positions ``0..seq-1``, shape (seq, dim / 2); or for ``positions``:
    (seq,) ids give (seq, dim / 2), (batch, seq) ids (packed documents, ``layers.documents``) give
    (batch, seq, dim / 2), each token rotated by its own id (the same product as the plain tables)."""
    pos = torch.arange(seq, device=device) if positions is None else positions
    if pos.dim() == 2:
        angles = pos.to(dtype).unsqueeze(-1) * inv_freq(dim, spec, dtype).to(device)
    else:
        angles = torch.outer(pos.to(dtype), inv_freq(dim, spec, dtype).to(device))
    factor = spec.attention_factor()
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotate x (batch, seq, heads, dim) in cos/sin's dtype and cast back; cos/sin (seq, dim / 2) or, per row,
    (batch, seq, dim / 2)."""
    y = x.to(cos.dtype)
    if interleave:
        x0, x1 = y.unflatten(-1, (-1, 2)).unbind(-1)
    else:
        x0, x1 = y.chunk(2, dim=-1)
    if cos.dim() == 3:  # per row (packed documents): (batch, seq, 1, dim / 2)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    r0, r1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    out = torch.stack((r0, r1), dim=-1).flatten(-2) if interleave else torch.cat((r0, r1), dim=-1)
    return out.type_as(x)
