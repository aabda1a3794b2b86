"""RMSNorm: ``x / sqrt(mean(x²) + eps) · weight``, computed in ``compute_dtype`` and cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import compute_dtype


class RMSNorm(nn.Module):
    cheap_weight_grad = True  # its weight gradient is a cheap reduction: the runtime computes it during B

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == compute_dtype(x):
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        # low precision: normalise in float32, multiply by the weight in the input dtype (transformers' order)
        y = F.rms_norm(x.to(compute_dtype(x)), (x.size(-1),), None, self.eps).type_as(x)
        return y * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"

    def saved_per_token(self, policy: str, seq: int) -> dict[str, int]:
        """Eager ``F.rms_norm`` keeps its input, the normalised input (the weight's gradient) and 1/rms."""
        if policy == "full":
            return {}
        return {"input": self.weight.numel(), "normalized": self.weight.numel(), "rstd": 1}
