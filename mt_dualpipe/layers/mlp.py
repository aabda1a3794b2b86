"""The SwiGLU feed-forward ``down(silu(gate(x)) · up(x))`` (transformers' names), dense or one expert."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate)·up (recomputed in backward under ``"selective"``)."""
        return F.silu(gate) * up

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        if policy == "selective":
            yield self, "act", "swiglu"

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        """Per routed row for an expert: the input, gate and up outputs, the product (the down-projection
        keeps its input whether or not the activation is recomputed) and, unless ``"selective"``
        recomputes the activation, silu(gate)."""
        if policy == "full":
            return {}
        i = self.gate_proj.out_features
        kept = {"input": self.gate_proj.in_features, "gate": i, "up": i, "product": i}
        return kept if policy == "selective" else {**kept, "silu_gate": i}
