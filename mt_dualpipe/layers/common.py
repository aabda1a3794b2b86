"""What every layer shares: the precision of the numerically sensitive parts and building without init.

``compute_dtype``: RoPE, the attention softmax, the router and the loss run in float64 for a float64
model (so a test can compare it with a reference to ~1e-15) and in float32 otherwise.
``deferred_init``: skip ``nn.Linear`` / ``nn.Embedding``'s default init while a model is built (the
family's init, or the checkpoint loader, overwrites every weight anyway; on the meta device a large
model then builds in seconds).
``SavedPerToken``: what a module keeps for backward per token under a recompute policy, in elements
of the activation dtype — the declaration the planner's memory model reads. A tensor kept in another
dtype counts as its bytes over the activation dtype's (``Elements``: float32 copies in a bf16 model, the
E4M3 copies FP8 linears keep of their inputs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@contextmanager
def deferred_init() -> Iterator[None]:
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def init_normal(module: nn.Module, std: float) -> None:
    """Linears and embeddings ~ N(0, std²), linear biases and an embedding's padding row zero (as transformers'
    ``_init_weights``; under ``deferred_init`` nothing else initialises them), norm weights keep their ones; meta
    tensors are skipped."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:
            nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()


@runtime_checkable
class SavesPerToken(Protocol):
    """A module that states what it keeps for backward, per token, under a recompute policy.

    ``saved_per_token(policy)`` -> {tensor name: elements per token}; the sum times the activation
    dtype's size is the module's per-token activation memory (the S×S attention probabilities, which
    grow with the sequence, are reported per token at the given ``seq`` as ``heads * seq``)."""

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        ...


INDEX_BYTES = 8  # an int64 index
FP8_COPY_BYTES = 1 + 4 / 128  # an E4M3 element plus its share of one float32 scale per 1×128 tile


class Elements:
    """Bytes kept for backward expressed in elements of a module's activation dtype (its first floating
    parameter's; the declarations' unit): ``compute(n)`` n elements in ``compute_dtype``, ``index(n)`` int64
    indices, ``bools(n)``, ``linear_input(linear, n)`` what a linear keeps of an n-feature input (the input itself,
    or the E4M3 copy an FP8 linear keeps)."""

    def __init__(self, module: nn.Module) -> None:
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        self.itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        self.compute_itemsize = 8 if dtype == torch.float64 else 4

    @property
    def upcast(self) -> bool:
        """Whether ``compute_dtype`` differs from the activation dtype (a casting copy is then a new tensor)."""
        return self.compute_itemsize != self.itemsize

    def compute(self, n: float) -> float:
        return n * self.compute_itemsize / self.itemsize

    def index(self, n: float) -> float:
        return n * INDEX_BYTES / self.itemsize

    def bools(self, n: float) -> float:
        return n / self.itemsize

    def fp8(self, n: float) -> float:
        return n * FP8_COPY_BYTES / self.itemsize

    def linear_input(self, linear: nn.Module, n: float) -> float:
        return self.fp8(n) if is_fp8(linear) else float(n)


def is_fp8(linear: nn.Module) -> bool:
    """Whether ``linear`` keeps an E4M3 copy of its input rather than the input (``fp8.FP8Linear``, or any linear
    that quantises its input itself)."""
    return hasattr(linear, "quantize_input")


def saved_elements_per_token(module: nn.Module, policy: str, seq: int) -> float:
    """The sum over the declaring modules of ``module``'s tree; a declaration covers its whole subtree
    (the walk does not descend below a module that declares)."""
    if isinstance(module, SavesPerToken):
        return sum(module.saved_per_token(policy, seq).values())
    return sum(saved_elements_per_token(child, policy, seq) for child in module.children())
