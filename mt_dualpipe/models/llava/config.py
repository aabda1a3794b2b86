"""LLaVA's sizes, read from and written to a Hugging Face ``config.json`` (``model_type: llava``).

Three parts, as in transformers: ``vision`` (a CLIP or SigLIP vision tower, ``clip_vision_model`` /
``siglip_vision_model``), ``text`` (a Llama decoder) and the fields that join them (the image token,
the projector's activation, which vision hidden state feeds the projector). Fields this family cannot
honour are refused with the field's name rather than ignored: a list of feature layers, a Llama with
biased attention or another activation, attention dropout, an unknown vision tower.

Which vision layers run: transformers takes ``hidden_states[vision_feature_layer]`` of the tower, where
index 0 is the embedding output and index k the output of encoder layer k-1; ``feature_index`` is
that index made non-negative, so the tower runs its first ``feature_index`` layers and the rest (and
``post_layernorm``, which LLaVA never reads) are kept only to be saved again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ...layers.rope import RopeSpec

MODEL_TYPE = "llava"
VISION_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")
PROJECTOR_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu")
SELECT_STRATEGIES = ("default", "full")


def _refuse(data: dict[str, Any], where: str, fine: dict[str, tuple]) -> None:
    for key, allowed in fine.items():
        if data.get(key) not in allowed:
            raise ValueError(f"{where} field {key}={data.get(key)!r} is not supported for LLaVA "
                             f"(supported: {[a for a in allowed if a is not None]})")


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP (class token, ``pre_layrnorm``, bias-free patch conv, quick_gelu) or SigLIP (no class
    token, biased patch conv, gelu-tanh, optional pooling head) vision tower."""

    kind: str = "clip"
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    vision_use_head: bool = False  # SigLIP's attention-pooling head (LLaVA never runs it)
    projection_dim: int | None = 768  # CLIP's, carried for the round trip (the tower has no projection); SigLIP: None
    initializer_range: float = 0.02
    initializer_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in VISION_TYPES.values():
            raise ValueError(f"vision tower {self.kind!r} is not supported; choose clip or siglip")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size ({self.image_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported; choose one of "
                             f"{VISION_ACTIVATIONS}")
        if self.vision_use_head and self.kind != "siglip":
            raise ValueError("vision_use_head is a SigLIP field; a CLIP tower has no pooling head")
        if self.kind == "siglip" and self.projection_dim is not None:
            object.__setattr__(self, "projection_dim", None)  # a CLIP field: SigLIP's config has none to carry

    @property
    def class_token(self) -> bool:
        return self.kind == "clip"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Tokens the encoder sees per image: the patches, plus CLIP's class token."""
        return self.num_patches + (1 if self.class_token else 0)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> VisionConfig:
        model_type = data.get("model_type", "clip_vision_model")
        if model_type not in VISION_TYPES:
            raise ValueError(f"vision_config model_type={model_type!r} is not supported for LLaVA; "
                             f"choose one of {sorted(VISION_TYPES)}")
        kind = VISION_TYPES[model_type]
        _refuse(data, "vision_config", {"attention_dropout": (0, 0.0, None)})
        default_act = "quick_gelu" if kind == "clip" else "gelu_pytorch_tanh"
        # an absent field means transformers' CLIPVisionConfig / SiglipVisionConfig default
        return cls(kind=kind, hidden_size=int(data.get("hidden_size", 768)),
                   intermediate_size=int(data.get("intermediate_size", 3072)),
                   num_hidden_layers=int(data.get("num_hidden_layers", 12)),
                   num_attention_heads=int(data.get("num_attention_heads", 12)),
                   image_size=int(data.get("image_size", 224)),
                   patch_size=int(data.get("patch_size", 32 if kind == "clip" else 16)),
                   num_channels=int(data.get("num_channels", 3)),
                   layer_norm_eps=float(data.get("layer_norm_eps", 1e-5 if kind == "clip" else 1e-6)),
                   hidden_act=str(data.get("hidden_act", default_act)),
                   vision_use_head=bool(data.get("vision_use_head", kind == "siglip")),
                   projection_dim=int(data.get("projection_dim", 512)) if kind == "clip" else None,
                   initializer_range=float(data.get("initializer_range") or 0.02),
                   initializer_factor=float(data.get("initializer_factor") or 1.0))

    def to_hf(self) -> dict[str, Any]:
        model_type = next(t for t, k in VISION_TYPES.items() if k == self.kind)
        out = {k: v for k, v in asdict(self).items() if k not in ("kind", "vision_use_head", "projection_dim",
                                                                   "initializer_factor")}
        out.update(model_type=model_type, attention_dropout=0.0)
        if self.kind == "clip":
            out.update(projection_dim=self.projection_dim, initializer_factor=self.initializer_factor)
        else:
            out["vision_use_head"] = self.vision_use_head
        return out


@dataclass(frozen=True)
class TextConfig:
    """The Llama decoder (GQA, SwiGLU, RMSNorm, RoPE with optional Llama-3 or YaRN scaling)."""

    vocab_size: int = 32064
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope: RopeSpec = field(default_factory=lambda: RopeSpec(10000.0))
    max_position_embeddings: int = 4096
    mlp_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"text num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> TextConfig:
        if data.get("model_type", "llama") != "llama":
            raise ValueError(f"text_config model_type={data.get('model_type')!r} is not supported for LLaVA; "
                             "only a Llama language model ('llama')")
        _refuse(data, "text_config", {"hidden_act": ("silu", None), "attention_bias": (False, None),
                                      "attention_dropout": (0, 0.0, None)})
        heads = int(data.get("num_attention_heads", 32))
        hidden = int(data.get("hidden_size", 4096))
        eos = data.get("eos_token_id", 2)
        return cls(vocab_size=int(data.get("vocab_size", 32000)), hidden_size=hidden,
                   intermediate_size=int(data.get("intermediate_size", 11008)),
                   num_hidden_layers=int(data.get("num_hidden_layers", 32)), num_attention_heads=heads,
                   num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                   head_dim=int(data.get("head_dim") or hidden // heads),
                   rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), rope=RopeSpec.from_hf(data),
                   max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
                   mlp_bias=bool(data.get("mlp_bias", False)),
                   initializer_range=float(data.get("initializer_range") or 0.02),
                   bos_token_id=data.get("bos_token_id", 1), eos_token_id=eos if not isinstance(eos, list) else None,
                   pad_token_id=data.get("pad_token_id"))

    def to_hf(self, tie_word_embeddings: bool) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "rope"}
        out.update(model_type="llama", hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                   rope_parameters=self.rope.to_hf(), tie_word_embeddings=tie_word_embeddings)
        return out


@dataclass(frozen=True)
class LlavaConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    text: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 32000
    image_seq_length: int = 576  # carried: the processor's tokens per image (the model counts its own)
    projector_hidden_act: str = "gelu"
    vision_feature_layer: int = -2
    vision_feature_select_strategy: str = "default"
    multimodal_projector_bias: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.vision_feature_layer, bool) or not isinstance(self.vision_feature_layer, int):
            raise ValueError(f"vision_feature_layer must be one int (a list of layers, concatenated, is not "
                             f"supported), got {self.vision_feature_layer!r}")
        n = self.vision.num_hidden_layers
        if not -(n + 1) <= self.vision_feature_layer <= n:
            raise ValueError(f"vision_feature_layer {self.vision_feature_layer} is outside the tower's hidden "
                             f"states (-{n + 1}..{n})")
        if self.vision_feature_select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.vision_feature_select_strategy!r} is not "
                             f"supported; choose one of {SELECT_STRATEGIES}")
        if self.projector_hidden_act not in PROJECTOR_ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {self.projector_hidden_act!r} is not supported; choose one of "
                             f"{PROJECTOR_ACTIVATIONS}")
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary "
                             f"(0..{self.text.vocab_size - 1})")
        if self.tokens_per_image < 1:
            raise ValueError("the vision tower leaves no feature per image (one patch and strategy 'default')")

    # ----- derived sizes ------------------------------------------------------------------------------
    @property
    def feature_index(self) -> int:
        """The index into the tower's hidden states (0: embeddings, k: after encoder layer k-1)."""
        return self.vision_feature_layer % (self.vision.num_hidden_layers + 1)

    @property
    def vision_layers_used(self) -> int:
        """Encoder layers the tower runs; the others get no gradient (built frozen)."""
        return self.feature_index

    @property
    def tokens_per_image(self) -> int:
        """Image tokens one image fills: the tower's positions, less the first under ``"default"``."""
        drop = 1 if self.vision_feature_select_strategy == "default" else 0
        return self.vision.num_positions - drop

    @property
    def num_hidden_layers(self) -> int:
        """The text decoder layers (what a pipeline cuts)."""
        return self.text.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    def replace(self, **changes: Any) -> LlavaConfig:
        """A copy with top-level fields changed; ``vision=`` / ``text=`` may be dicts of their fields."""
        for part in ("vision", "text"):
            if isinstance(changes.get(part), dict):
                changes[part] = replace(getattr(self, part), **changes[part])
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, tower: str = "clip", **overrides: Any) -> LlavaConfig:
        """``"tiny"`` (tests and examples): an 8x8 image in 4x4 patches, 3 vision layers (the last unused
        under ``vision_feature_layer=-2``), a 4-layer Llama of width 32; ``tower`` "clip" or "siglip"."""
        if name != "tiny":
            raise ValueError(f"unknown LLaVA preset {name!r}; choose 'tiny'")
        vision = VisionConfig(kind=tower, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                              num_attention_heads=2, image_size=8, patch_size=4,
                              layer_norm_eps=1e-5 if tower == "clip" else 1e-6,
                              hidden_act="quick_gelu" if tower == "clip" else "gelu_pytorch_tanh",
                              vision_use_head=tower == "siglip", projection_dim=8)
        text = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                          max_position_embeddings=256, pad_token_id=0)
        base = cls(vision=vision, text=text, image_token_id=63, image_seq_length=4,
                   vision_feature_select_strategy="default" if tower == "clip" else "full",
                   vision_feature_layer=-2 if tower == "clip" else -1)
        return base.replace(**overrides) if overrides else base

    # ----- Hugging Face -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict[str, Any], **overrides: Any) -> LlavaConfig:
        if data.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config model_type={data.get('model_type')!r} is not {MODEL_TYPE!r}")
        for part in ("vision_config", "text_config"):
            if not isinstance(data.get(part), dict):
                raise ValueError(f"a LLaVA config.json needs its {part} (a dict), got {data.get(part)!r}")
        if data.get("ignore_index", -100) != -100:  # older configs carry the loss's ignore index
            raise ValueError(f"config field ignore_index={data['ignore_index']!r} is not supported for LLaVA "
                             "(the loss ignores -100)")
        ids = {data[k] for k in ("image_token_index", "image_token_id") if data.get(k) is not None}
        if len(ids) > 1:
            raise ValueError(f"image_token_index and image_token_id disagree: {sorted(ids)}")
        text = data["text_config"]
        tied = bool(data.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
        kwargs = dict(vision=VisionConfig.from_hf(data["vision_config"]), text=TextConfig.from_hf(text),
                      image_token_id=int(ids.pop() if ids else 32000),
                      image_seq_length=int(data.get("image_seq_length", 576)),
                      projector_hidden_act=str(data.get("projector_hidden_act", "gelu")),
                      vision_feature_layer=data.get("vision_feature_layer", -2),
                      vision_feature_select_strategy=str(data.get("vision_feature_select_strategy", "default")),
                      multimodal_projector_bias=bool(data.get("multimodal_projector_bias", True)),
                      tie_word_embeddings=tied)
        return cls(**{**kwargs, **overrides})

    def to_hf(self) -> dict[str, Any]:
        return dict(model_type=MODEL_TYPE, architectures=["LlavaForConditionalGeneration"],
                    vision_config=self.vision.to_hf(), text_config=self.text.to_hf(self.tie_word_embeddings),
                    image_token_index=self.image_token_id, image_seq_length=self.image_seq_length,
                    projector_hidden_act=self.projector_hidden_act, vision_feature_layer=self.vision_feature_layer,
                    vision_feature_select_strategy=self.vision_feature_select_strategy,
                    multimodal_projector_bias=self.multimodal_projector_bias,
                    tie_word_embeddings=self.tie_word_embeddings)
