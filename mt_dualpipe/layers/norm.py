"""RMSNorm: ``x / sqrt(mean(x²) + eps) · weight``, computed in ``compute_dtype`` and cast back.

``recompute=True`` (DeepSeek-V3's ``"norm"`` memory saver, report §3.2.3 "recomputation of RMSNorm"):
keep only the input, which the residual stream holds anyway, and re-run the norm in B, instead of the
float32 copies eager autograd keeps. Both paths call the same ``rms_norm``, so gradients are bit-equal.

``fused=True``: one ``F.rms_norm`` in the input dtype whatever it is (DeepSeek-V3's reference
implementation, whose runtime and planner figures assume what that call keeps); the default follows
transformers (low precision: normalise in float32, cast, then multiply by the weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import Elements, compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = False) -> torch.Tensor:
    """The norm itself. Full precision or ``fused``: one ``F.rms_norm``. Low precision: normalise in float32,
    cast, then multiply by the weight in the input dtype (transformers' order)."""
    if fused or x.dtype == compute_dtype(x):
        # ``F.rms_norm`` decomposes into two uses of x (its square and its product with 1/rms); the view gives
        # them one autograd node, so x's gradient gets this norm's share as one sum, as from a compiled norm
        # (whose graph returns one gradient per input). Then whether the norm is compiled does not change
        # the order in which the engine adds it to the residual's share (float addition is not associative).
        return F.rms_norm(x.view_as(x), (x.size(-1),), weight, eps)
    y = F.rms_norm(x.to(compute_dtype(x)), (x.size(-1),), None, eps).type_as(x)
    return y * weight.to(x.dtype)


class _RecomputedRMSNorm(torch.autograd.Function):
    """``rms_norm`` keeping only its input (and the weight, a parameter); B re-runs and differentiates the
    same call, so the gradients are bit-equal to eager's. The weight gradient is computed in B, as the
    runtime expects of a ``cheap_weight_grad`` module."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.fused = eps, fused
        return rms_norm(x, weight, eps, fused)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(need_x), weight.detach().requires_grad_(need_w)
            y = rms_norm(xd, wd, ctx.eps, ctx.fused)
        wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
        got = iter(torch.autograd.grad(y, wanted, grad) if wanted else ())
        return (next(got) if need_x else None), (next(got) if need_w else None), None, None


class RMSNorm(nn.Module):
    cheap_weight_grad = True  # its weight gradient is a cheap reduction: the runtime computes it during B

    def __init__(self, dim: int, eps: float = 1e-6, recompute: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.recompute, self.fused = recompute, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            out = _RecomputedRMSNorm.apply(x, self.weight, self.eps, self.fused)
            # how to rebuild this output from what the norm keeps (``rms_norm(*source)``): a reader that needs
            # its input in B (a router's ``"router"`` saver, ``router.Router``) re-derives it instead of keeping it
            out.rms_norm_source = (x, self.weight, self.eps, self.fused)
            return out
        return rms_norm(x, self.weight, self.eps, self.fused)

    def extra_repr(self) -> str:
        return (f"{self.weight.numel()}, eps={self.eps}" + (", recompute" if self.recompute else "")
                + (", fused" if self.fused else ""))

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """Eager ``F.rms_norm`` keeps its input, the normalised input (the weight's gradient) and 1/rms, in
        elements (``fused`` in a low-precision model: a float32 copy of the input, the float32 normalised input
        and 1/rms); with ``recompute`` only the input."""
        if policy == "full":
            return {}
        d = self.weight.numel()
        if self.recompute:
            return {"input": d}
        e = Elements(self)
        if self.fused and e.upcast:
            return {"input_upcast": e.compute(d), "normalized": e.compute(d), "rstd": e.compute(1)}
        return {"input": d, "normalized": d, "rstd": 1}
