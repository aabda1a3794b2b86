"""What every layer shares: the precision of the numerically sensitive parts and building without init.

``compute_dtype``: RoPE, the attention softmax, the router and the loss run in float64 for a float64
model (so a test can compare it with a reference to ~1e-15) and in float32 otherwise.
``deferred_init``: skip ``nn.Linear`` / ``nn.Embedding``'s default init while a model is built (the
family's init, or the checkpoint loader, overwrites every weight anyway; on the meta device a large
model then builds in seconds).
``SavedPerToken``: what a module keeps for backward per token under a recompute policy, in elements
of the activation dtype — the declaration the planner's memory model is meant to read.
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

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        ...


def saved_elements_per_token(module: nn.Module, policy: str, seq: int) -> int:
    """The sum over the declaring modules of ``module``'s tree; a declaration covers its whole subtree
    (the walk does not descend below a module that declares)."""
    if isinstance(module, SavesPerToken):
        return sum(module.saved_per_token(policy, seq).values())
    return sum(saved_elements_per_token(child, policy, seq) for child in module.children())
