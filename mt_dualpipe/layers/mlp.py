"""The SwiGLU feed-forward ``down(silu(gate(x)) · up(x))`` (transformers' names), dense or one expert.

``recompute_product`` (the ``"swiglu"`` saver, ``savers.py``): the product silu(gate)·up is not kept from F to
B; ``SwiGLUProduct`` keeps only gate and up (E4M3 with 1×128 scales when the up-projections are FP8) and
rebuilds the product in B, and with an FP8 down-projection ``fp8.linear.fp8_swiglu_down`` does not keep the
down-projection's input either. With FP8 up-projections the input is quantised once for both (one FP8
copy kept for their weight gradients). ``row_weight`` (rows, 1), the ``"combine"`` saver's gate weight
(``moe.MoEBlock``), scales each row's product before the down-projection. ``selective`` False: the
``"selective"`` recompute policy leaves the product alone (DeepSeek-V3's selective recomputes MLA only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.linear import FP8Linear, fp8_swiglu_down
from ..fp8.quantize import QTensor, dequantize, quantize_tiles
from .common import Elements, is_fp8


def swiglu(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    out = F.silu(gate) * up
    return out if row_weight is None else out * row_weight


class SwiGLUProduct(torch.autograd.Function):
    """``swiglu(gate, up, row_weight)`` keeping only its inputs for B (``fp8``: gate and up in E4M3 with one
    float32 scale per 1×128 tile, the product rebuilt from their dequantised values; otherwise as they
    are, and the backward differentiates the same ops as eager autograd: bit-equal gradients). The forward
    always uses the exact inputs."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None,
                fp8: bool) -> torch.Tensor:
        ctx.fp8 = fp8
        ctx.like = ((gate.shape, gate.dtype), (up.shape, up.dtype))
        if fp8:  # all through save_for_backward: the runtime's saved-tensor hooks see (and count) them
            g = quantize_tiles(gate.detach().reshape(-1, gate.shape[-1]))
            u = quantize_tiles(up.detach().reshape(-1, up.shape[-1]))
            ctx.save_for_backward(g.data, g.scale, u.data, u.scale, row_weight)
        else:
            ctx.save_for_backward(gate, up, row_weight)
        return swiglu(gate, up, row_weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        saved = ctx.saved_tensors
        if not ctx.fp8:
            gate, up, weight = saved
        else:
            (gshape, gdtype), (ushape, udtype) = ctx.like
            gate = dequantize(QTensor(saved[0], saved[1], "tile")).to(gdtype).view(gshape)
            up = dequantize(QTensor(saved[2], saved[3], "tile")).to(udtype).view(ushape)
            weight = saved[4]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((gate, up, weight), ctx.needs_input_grad)]
            out = swiglu(*leaves)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(got) if t is not None and t.requires_grad else None for t in leaves), None)


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, recompute_product: bool = False,
                 selective: bool = True) -> None:
        super().__init__()
        self.selective = selective  # whether the "selective" policy recomputes the product (Megatron's, Llama's)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.recompute_product = recompute_product

    def _fp8_up(self) -> bool:
        return isinstance(self.gate_proj, FP8Linear) and isinstance(self.up_proj, FP8Linear)

    def forward(self, x: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
        fp8 = self._fp8_up() and x.numel() > 0
        if fp8:  # both up-projections keep the same FP8 copy of the input for their weight gradients
            xq = FP8Linear.quantize_input(x)
            gate, up = self.gate_proj(x, xq), self.up_proj(x, xq)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        needs = gate.requires_grad or up.requires_grad or (row_weight is not None and row_weight.requires_grad)
        if self.recompute_product and torch.is_grad_enabled() and needs:
            down = self.down_proj
            if fp8 and isinstance(down, FP8Linear) and down.bias is None:  # its input is not kept either
                return fp8_swiglu_down(gate, up, row_weight, down)
            return down(SwiGLUProduct.apply(gate, up, row_weight, fp8))
        return self.down_proj(self.act(gate, up, row_weight))

    def act(self, gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate)·up (recomputed in backward under ``"selective"``)."""
        return swiglu(gate, up, row_weight)

    def recompute_regions(self, policy: str) -> Iterator[tuple[nn.Module, str, str]]:
        if policy == "selective" and self.selective and not self.recompute_product:
            yield self, "act", "swiglu"

    def saved_per_token(self, policy: str, seq: int) -> dict[str, float]:
        """Per row (a token, or a routed row for an expert): the input (with FP8 up-projections their one
        E4M3 copy), gate and up outputs, the product (the down-projection keeps its input whether or not the
        activation is recomputed; an E4M3 copy with an FP8 one) and, unless ``"selective"`` recomputes the
        activation, silu(gate). With ``recompute_product`` gate and up (E4M3 with FP8 up-projections) and the
        product, which an FP8 down-projection rebuilds in B instead (``fp8_swiglu_down``)."""
        if policy == "full":
            return {}
        e = Elements(self)
        i = self.gate_proj.out_features
        fp8_up = self._fp8_up()
        kept = {"input": e.linear_input(self.gate_proj, self.gate_proj.in_features)}
        if self.recompute_product:
            kept.update(gate=e.fp8(i) if fp8_up else i, up=e.fp8(i) if fp8_up else i)
            if not (fp8_up and is_fp8(self.down_proj) and self.down_proj.bias is None):
                kept["product"] = e.linear_input(self.down_proj, i)
            return kept
        kept.update(gate=i, up=i, product=e.linear_input(self.down_proj, i))
        return kept if policy == "selective" and self.selective else {**kept, "silu_gate": i}
