"""The vision tower: a ViT encoder in CLIP's or SigLIP's layout, under transformers' module names.

Both are pre-norm ViTs with ``nn.LayerNorm``, biased q/k/v/out projections and a two-layer MLP; they
differ in the embedding (CLIP: a class token, a bias-free patch convolution; SigLIP: no class token,
a biased convolution), CLIP's extra ``pre_layrnorm`` and the activation (``VisionConfig.hidden_act``).
Attention is bidirectional (every patch sees every patch), so ``layers.GQAttention`` (causal, RoPE)
does not fit; ``VisionAttention`` is its plain counterpart, softmax in ``compute_dtype`` like the rest
of the shared layer.

Each module declares what autograd keeps of it per position (``saved_per_token(policy, positions)``, in
elements; the planner's ``spec.vision_costs`` reads them): a ``LayerNorm`` its input, mean and 1/std
(h + 2); the attention the projections' input, q, k, v and the core's output (5h) and, unless
``"selective"`` recomputes the core, the probabilities (heads x positions); the MLP its input, the first
linear's output and what the activation keeps (``ACTIVATION_SAVED``: quick_gelu also its sigmoid); the
patch convolution the pixels; under ``"full"`` a layer keeps only its input.

LLaVA reads one hidden state of the tower (``LlavaConfig.feature_index``), so the tower runs only the
layers below it. The layers above, ``post_layernorm`` and SigLIP's pooling ``head`` never run: they are
built (so a checkpoint loads and saves whole) but frozen (``requires_grad=False``), so an optimizer,
the runtime's data-parallel gradient sync (``parallel.stage_sync.stage_params`` keeps trainable
parameters only) and ``layers.replicas`` never see a parameter that cannot have a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ...layers import compute_dtype
from .config import LlavaConfig, VisionConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh, "silu": F.silu, "relu": F.relu,
}
ACTIVATION_SAVED = {"quick_gelu": 2, "gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "relu": 1}
"""Tensors of the activation's width its autograd keeps besides the output the next linear keeps (quick_gelu:
its input and its sigmoid; the others one: their input, or relu's output)."""


def layer_norm_saved(hidden: int) -> int:
    """What ``nn.LayerNorm`` keeps per position: its input, the mean and 1/std."""
    return hidden + 2


class VisionEmbeddings(nn.Module):
    """Patches by a strided convolution, CLIP's class token in front, learned absolute positions."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.image_size = c.image_size
        if c.class_token:
            self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size,
                                         bias=not c.class_token)
        self.position_embedding = nn.Embedding(c.num_positions, c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(images, C, H, W) -> (images, positions, hidden)."""
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"images of {tuple(pixels.shape[-2:])} pixels; the tower takes "
                             f"{self.image_size}x{self.image_size} (position interpolation is not supported)")
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        if hasattr(self, "class_embedding"):
            x = torch.cat([self.class_embedding.expand(x.size(0), 1, -1).to(x.dtype), x], dim=1)
        return x + self.position_embedding.weight

    def saved_per_token(self, policy: str, positions: int) -> dict[str, float]:
        """The convolution keeps the pixels: C x H x W per image, spread over its positions."""
        c, size = self.patch_embedding.in_channels, self.image_size
        return {"pixels": c * size * size / positions}


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:2], self.heads, self.head_dim)
        q, k, v = (proj(x).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(self.core(q, k, v))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """QKᵀ·d^-½, softmax over all positions (``compute_dtype``), ·V."""
        scores = torch.einsum("bshd,bthd->bhst", q, k) * self.head_dim ** -0.5
        probs = scores.softmax(dim=-1, dtype=compute_dtype(q)).type_as(q)
        return torch.einsum("bhst,bthd->bshd", probs, v).flatten(2)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        if policy == "selective":
            yield self, "core", "vision_core_attention"

    def saved_per_token(self, policy: str, positions: int) -> dict[str, int]:
        """The projections' input, q, k, v and the core output (``out_proj``'s input), and the probabilities
        unless ``"selective"`` recomputes the core (its region keeps q, k, v, which the projections keep)."""
        if policy == "full":
            return {}
        hidden = self.heads * self.head_dim
        out = {"input": hidden, "qkv": 3 * hidden, "core_out": hidden}
        return out if policy == "selective" else {**out, "probs": self.heads * positions}


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.act, self.act_saved = ACTIVATIONS[act], ACTIVATION_SAVED[act]
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def saved_per_token(self, policy: str, positions: int) -> dict[str, int]:
        if policy == "full":
            return {}
        return {"input": self.fc1.in_features, "activation": self.fc1.out_features * self.act_saved,
                "fc2_input": self.fc1.out_features}


class VisionEncoderLayer(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = VisionAttention(c.hidden_size, c.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        if policy == "full":
            yield self, "forward", "vision_layer"

    def saved_per_token(self, policy: str, positions: int) -> dict[str, float]:
        """Its norms, attention and MLP; under ``"full"`` (the whole layer recomputed) only its input."""
        hidden = self.layer_norm1.normalized_shape[0]
        if policy == "full":
            return {"input": hidden}
        return {"layer_norm1": layer_norm_saved(hidden), "layer_norm2": layer_norm_saved(hidden),
                **{f"attn_{k}": v for k, v in self.self_attn.saved_per_token(policy, positions).items()},
                **{f"mlp_{k}": v for k, v in self.mlp.saved_per_token(policy, positions).items()}}


class VisionEncoder(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(c) for _ in range(c.num_hidden_layers))


class PoolingHead(nn.Module):
    """SigLIP's attention-pooling head (``head.probe``, ``head.attention``, ``head.layernorm``, ``head.mlp``):
    held for the checkpoint round trip only; LLaVA reads patch features, never the pooled one."""

    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.attention = nn.MultiheadAttention(c.hidden_size, c.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


class VisionTower(nn.Module):
    """transformers' ``CLIPVisionModel`` / ``SiglipVisionModel`` parameters; ``forward`` returns the hidden
    state LLaVA selects (after ``config.vision_layers_used`` encoder layers)."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        c = config.vision
        self.used = config.vision_layers_used
        self.embeddings = VisionEmbeddings(c)
        if c.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.encoder = VisionEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        if c.vision_use_head:
            self.head = PoolingHead(c)
        for module in self.unused_modules():
            module.requires_grad_(False)

    def unused_modules(self) -> list[nn.Module]:
        """What LLaVA never runs: the encoder layers above the feature layer, ``post_layernorm``, ``head``."""
        out: list[nn.Module] = list(self.encoder.layers[self.used:]) + [self.post_layernorm]
        return out + ([self.head] if hasattr(self, "head") else [])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        if hasattr(self, "pre_layrnorm"):
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:self.used]:
            x = layer(x)
        return x

    def saved_per_token(self, policy: str, positions: int) -> dict[str, float]:
        """Per position: the embedding's, CLIP's ``pre_layrnorm`` and the layers that run (not the frozen ones)."""
        out = dict(self.embeddings.saved_per_token(policy, positions))
        if hasattr(self, "pre_layrnorm"):
            out["pre_layrnorm"] = layer_norm_saved(self.pre_layrnorm.normalized_shape[0])
        for i, layer in enumerate(self.encoder.layers[:self.used]):
            out[f"layer{i}"] = sum(layer.saved_per_token(policy, positions).values())
        return out


class MultiModalProjector(nn.Module):
    """``linear_1`` -> activation -> ``linear_2``: vision width to text width."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        bias = config.multimodal_projector_bias
        self.linear_1 = nn.Linear(config.vision.hidden_size, config.text.hidden_size, bias=bias)
        act = config.projector_hidden_act
        self.act, self.act_saved = ACTIVATIONS[act], ACTIVATION_SAVED[act]
        self.linear_2 = nn.Linear(config.text.hidden_size, config.text.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))

    def saved_per_token(self, policy: str, positions: int) -> dict[str, int]:
        """Per image token: ``linear_1``'s input, the activation's and ``linear_2``'s input (never recomputed)."""
        text = self.linear_1.out_features
        return {"input": self.linear_1.in_features, "activation": text * self.act_saved, "linear_2_input": text}


def init_vision(tower: VisionTower, config: VisionConfig) -> None:
    """Fresh weights for training from scratch: transformers' scales (class token ~ N(0, 1/hidden), the
    rest ~ N(0, initializer_range), biases zero); meta tensors are skipped."""
    std = config.initializer_range * config.initializer_factor
    for m in tower.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)) and not m.weight.is_meta:
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    emb = tower.embeddings
    if hasattr(emb, "class_embedding") and not emb.class_embedding.is_meta:
        nn.init.normal_(emb.class_embedding, 0.0, config.hidden_size ** -0.5 * config.initializer_factor)
