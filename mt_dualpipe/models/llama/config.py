"""Llama 3 hyper-parameters (the Hugging Face ``LlamaConfig`` fields we run), presets and HF conversion.

Field names are transformers' own, so ``from_hf`` / ``to_hf`` are a check and a copy: values that
would make this implementation compute a different function (attention or MLP biases, another
activation, a rope type other than none/``llama3``) are refused with the field named. ``rope`` is the
same frequencies as the shared layer's ``RopeSpec``, which the attention takes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...layers.rope import RopeSpec, supported_scaling
from ...layers.savers import SaverSwitches
from ..hf_checkpoint import check_fp8_quantization


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent rope scaling: wavelengths longer than ``original / low_freq_factor``
    are divided by ``factor``, shorter than ``original / high_freq_factor`` kept, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")


_PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json: 8.03 B parameters
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072,
               rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
    # CPU-sized, every structural feature kept (GQA 2:1, llama3 rope scaling, untied head)
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=1024,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 128)),
}
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "model_type": "llama",
             "attention_dropout": 0.0, "pretraining_tp": 1}
_METADATA = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "use_cache", "_name_or_path", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "problem_type", "return_dict", "quantization_config",
})
_ROPE_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


@dataclass(frozen=True)
class LlamaConfig(SaverSwitches):
    """A Llama-3-architecture decoder: GQA attention with RoPE, SwiGLU MLP, RMSNorm, tied or untied head.
    ``memory_savers``: the activation savers that are on (``layers.savers``; not a checkpoint field)."""

    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    pad_token_id: int | None = None  # the embedding's padding_idx: that row gets no gradient (transformers')
    hf_extra: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    memory_savers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.check_savers()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) (grouped-query attention)")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                             f"({self.num_attention_heads}) unless head_dim is given")
        if self.dim_per_head % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.dim_per_head}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rope(self) -> RopeSpec:
        """``rope_theta`` and ``rope_scaling`` as the shared layer's ``RopeSpec`` (plain, or ``llama3``)."""
        if self.rope_scaling is None:
            return RopeSpec(self.rope_theta)
        return RopeSpec(self.rope_theta, "llama3", tuple(sorted(asdict(self.rope_scaling).items())))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """``"8b"`` (Llama 3.1 8B) or ``"tiny"`` (CPU-sized); keyword overrides win."""
        if name not in _PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(_PRESETS)}")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"unknown LlamaConfig field(s) {bad}; fields are {sorted(known)}")
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any], **overrides: Any) -> LlamaConfig:
        """From a Hugging Face Llama ``config.json`` (dict, file or folder); unsupported values name the field."""
        if not isinstance(source, dict):
            path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"no Hugging Face config at {path} (expected a config.json or a folder)")
            source = json.loads(path.read_text())
        return cls(**{**_kwargs_from_hf(source), **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict (model_type ``llama``)."""
        out: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], **_REQUIRED}
        storage = ("quantization_config", "torch_dtype", "dtype")  # set by whoever writes the weights
        out.update({k: json.loads(v) for k, v in self.hf_extra if k not in storage})
        for f in fields(self):
            if f.name not in ("rope_scaling", "hf_extra", "memory_savers"):
                out[f.name] = getattr(self, f.name)
        out["head_dim"] = self.dim_per_head
        out["rope_scaling"] = None if self.rope_scaling is None else {"rope_type": "llama3",
                                                                      **asdict(self.rope_scaling)}
        return dict(sorted(out.items()))

    def replace(self, **changes: Any) -> LlamaConfig:
        return replace(self, **changes)


def _rope(data: dict[str, Any]) -> tuple[float | None, Llama3RopeScaling | None]:
    theta, params = supported_scaling(data, "Llama", "llama3", _ROPE_KEYS)
    return theta, None if params is None else Llama3RopeScaling(**params)


def _kwargs_from_hf(data: dict[str, Any]) -> dict[str, Any]:
    own = {f.name for f in fields(LlamaConfig)} - {"hf_extra", "rope_scaling", "memory_savers"}
    known = own | set(_REQUIRED) | _METADATA | {"rope_scaling", "rope_parameters"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"config field(s) {unknown} are not supported by the Llama family "
                         f"(known: {sorted(known)})")
    for key, want in _REQUIRED.items():
        if data.get(key) is not None and data[key] != want:
            raise ValueError(f"config field {key}={data[key]!r} is not supported: this Llama implementation runs "
                             f"{key}={want!r} only")
    if data.get("quantization_config") is not None:
        check_fp8_quantization(data["quantization_config"])
    kwargs = {k: v for k, v in data.items() if k in own and v is not None}
    theta, scaling = _rope(data)
    if theta is not None:
        kwargs["rope_theta"] = float(theta)
    kwargs["rope_scaling"] = scaling
    kwargs.setdefault("num_key_value_heads", data.get("num_attention_heads", LlamaConfig.num_attention_heads))
    extra = {k: v for k, v in data.items() if k in _METADATA}
    kwargs["hf_extra"] = tuple(sorted((k, json.dumps(v)) for k, v in extra.items()))
    return kwargs
