"""FP8Linear: ``nn.Linear`` with the three GEMMs in block-scaled E4M3 and a deferrable weight gradient.

Forward ``y = x Wᵀ``: x in 1×128 tiles along in_features, W in 128×128 blocks. Backward for the
input ``dx = dy W``: dy in 1×128 tiles along out_features, the same W blocks transposed. Backward for
the weight ``dW = dyᵀ x``: both operands tiled along the tokens (DeepSeek-V3's 128×1 tiles); x is
kept in FP8 from the forward (1×128 tiles) and re-quantised along the tokens when dW runs, as the
DeepSeek-V3 report describes. All GEMMs accumulate in FP32; the bias, the master weight and its
gradient stay in the parameter's dtype.

The weight-gradient GEMM is the ``W`` of the zero-bubble B/W split: when the runtime runs a B with
a ``WeightGradStore`` active, backward returns only the input gradient and queues a closure that
computes ``dW`` (and the bias gradient) and accumulates it into ``.grad`` when ``W`` runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime.activation_bytes import ActivationBytes
from ..runtime.weight_grad import WeightGradStore
from .backends import BACKENDS, Gemm, resolve_gemm
from .quantize import E4M3, QTensor, dequantize, quantize_blocks, quantize_tiles


def _deferrable(param: torch.Tensor | None, wanted: bool) -> bool:
    """A gradient can be queued only for a leaf parameter (its ``.grad`` is where autograd puts it)."""
    return not wanted or (param is not None and param.is_leaf)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                wq: QTensor, gemm: Gemm, xq: QTensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        if xq is None:
            xq = quantize_tiles(x.reshape(-1, x.shape[-1]))
        y = gemm(xq, wq)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        ctx.gemm, ctx.x_shape, ctx.x_dtype = gemm, x.shape, x.dtype
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves: a deferred W writes their .grad
        return y.to(x.dtype).reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        gemm, weight, bias = ctx.gemm, ctx.weight, ctx.bias
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            dx = gemm(quantize_tiles(dy), QTensor(w_data, w_scale, "block").t())
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (want_w or want_b):
            return dx, None, None, None, None, None

        def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            dw = db = None
            if want_w:
                x = dequantize(QTensor(x_data, x_scale, "tile"))
                dw = gemm(quantize_tiles(dy.t()), quantize_tiles(x.t()))
            if want_b:
                db = dy.float().sum(dim=0)
            return dw, db

        store = WeightGradStore.active()
        if store is not None and _deferrable(weight, want_w) and _deferrable(bias, want_b):
            store.put_grads((weight, bias), weight_grads)
            return dx, None, None, None, None, None
        dw, db = weight_grads()
        return (dx, None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None)


class FP8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters, init and state dict) computing in block-scaled FP8.

    ``backend``: ``"auto"`` (block-scaled ``scaled_mm`` where the device has it, else the emulation),
    ``"scaled_mm"`` (error where unavailable) or ``"emulated"``. The master weight stays in its dtype;
    its FP8 copy is cached and re-quantised whenever the weight changes (in-place optimizer steps
    included), so micro-batches of one step quantise it once. Outputs and input gradients come back
    in the input's dtype.

    Non-finite values: an inf or NaN anywhere in a 1×128 tile of the input (or of the output
    gradient) or in a 128×128 block of the weight turns that tile into NaN, so every output element
    it contributes to is NaN (never a saturated ±448 stand-in); see ``quantize.py``.

    Deferred weight gradients bypass autograd's accumulation (they are written to ``.grad`` when W
    runs), so gradient hooks registered on the parameters do not see them.
    """

    supports_deferred_weight_grad = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown FP8 backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend = backend
        self._wq_key: tuple | None = None
        self._wq: QTensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> FP8Linear:
        """An FP8Linear that shares ``linear``'s parameter objects (optimizers built before still work)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  backend=backend)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def quantized_weight(self) -> QTensor:
        """The 128×128-block E4M3 copy of the current weight (cached per weight version)."""
        w = self.weight
        key = (id(w), w._version, w.device, w.dtype)
        if self._wq is None or self._wq_key != key:
            with torch.no_grad():
                self._wq = quantize_blocks(w.detach())
            self._wq_key = key
        return self._wq

    @torch.no_grad()
    def load_quantized(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        """Take an E4M3 weight with one float32 scale per 128×128 block (an FP8 checkpoint's ``weight`` and
        ``weight_scale_inv``) as this layer's quantised weight, without re-quantising: the master weight
        becomes its dequantisation (in the weight's dtype) and the GEMMs use exactly ``data``/``scale``."""
        if tuple(data.shape) != tuple(self.weight.shape):
            raise ValueError(f"FP8 weight of shape {tuple(data.shape)} does not fit this layer's "
                             f"{tuple(self.weight.shape)}")
        if data.dtype != E4M3:
            raise ValueError(f"load_quantized expects float8_e4m3fn data, got {data.dtype}")
        q = QTensor(data.to(self.weight.device).contiguous(), scale.to(self.weight.device, torch.float32), "block")
        self.weight.copy_(dequantize(q).to(self.weight.dtype))
        w = self.weight
        self._wq, self._wq_key = q, (id(w), w._version, w.device, w.dtype)

    @property
    def active_backend(self) -> str:
        """The GEMM this layer runs on its weight's device: ``scaled_mm`` or ``emulated``."""
        return resolve_gemm(self.weight.device, self.backend)[0]

    @staticmethod
    def quantize_input(x: torch.Tensor) -> QTensor:
        """``x`` quantised as ``forward``'s ``xq`` wants it (1×128 tiles of ``x`` as 2-D, no gradient): how a
        module that feeds one input to several FP8 linears (``layers.mla``) shares one FP8 copy, without
        importing this module."""
        return quantize_tiles(x.detach().reshape(-1, x.shape[-1]))

    def forward(self, x: torch.Tensor, xq: QTensor | None = None) -> torch.Tensor:
        """``xq``: ``x`` already quantised in 1×128 tiles (``quantize_tiles`` of ``x`` as 2-D), e.g. shared by
        the two up-projections of a SwiGLU, so the FP8 copy kept for the weight gradient is stored once."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects inputs with last dimension {self.in_features}, got {tuple(x.shape)}")
        if xq is not None and (xq.kind != "tile" or xq.shape[0] != x.numel() // x.shape[-1]
                               or xq.shape[1] != x.shape[-1]):
            raise ValueError(f"xq must be the 1x128-tile quantisation of the input as 2-D "
                             f"({x.numel() // x.shape[-1]} x {x.shape[-1]}), got {xq.kind} {tuple(xq.shape)}")
        _, gemm = resolve_gemm(x.device, self.backend)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self.quantized_weight(), gemm, xq)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend}"


def _swiglu_product(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    out = torch.nn.functional.silu(gate) * up
    return out if row_weight is None else out * row_weight


class _FP8SwiGLUDownFunction(torch.autograd.Function):
    """``down(silu(gate)·up [· row_weight])`` with ``down`` an FP8 linear, keeping only gate and up in E4M3
    with 1×128 scales (DeepSeek-V3 report §3.3.2: the SwiGLU's inputs are cached and its output is
    recomputed in backward). The product, which is the down-projection's input, is not kept from F to
    B: B rebuilds it from the dequantised gate and up, uses it for the input gradients, and its FP8 copy
    is what the (possibly deferred) weight-gradient GEMM then holds until W, as ``FP8Linear`` would."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None,
                weight: torch.Tensor, wq: QTensor, gemm: Gemm) -> torch.Tensor:
        lead, ffn = gate.shape[:-1], gate.shape[-1]
        gq, uq = quantize_tiles(gate.detach().reshape(-1, ffn)), quantize_tiles(up.detach().reshape(-1, ffn))
        y = gemm(quantize_tiles(_swiglu_product(gate, up, row_weight).reshape(-1, ffn)), wq)
        ctx.save_for_backward(gq.data, gq.scale, uq.data, uq.scale, row_weight, wq.data, wq.scale)
        ctx.gemm, ctx.weight, ctx.shape, ctx.dtype = gemm, weight, gate.shape, gate.dtype
        return y.to(gate.dtype).reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        g_data, g_scale, u_data, u_scale, row_weight, w_data, w_scale = ctx.saved_tensors
        gemm, weight = ctx.gemm, ctx.weight
        gate = dequantize(QTensor(g_data, g_scale, "tile")).to(ctx.dtype).view(ctx.shape)
        up = dequantize(QTensor(u_data, u_scale, "tile")).to(ctx.dtype).view(ctx.shape)
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((gate, up, row_weight), ctx.needs_input_grad)]
            product = _swiglu_product(*leaves)
        dp = gemm(quantize_tiles(dy), QTensor(w_data, w_scale, "block").t()).to(ctx.dtype).view(ctx.shape)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(product, wanted, dp) if wanted else ())
        grads = [next(got) if t is not None and t.requires_grad else None for t in leaves]
        if not ctx.needs_input_grad[3]:
            return (*grads, None, None, None)
        pq = quantize_tiles(product.detach().reshape(-1, ctx.shape[-1]))
        del product
        recorder = ActivationBytes.active()
        if recorder is not None:  # held from B until W: the runtime counts it as W-held, like a recomputed input
            recorder.recomputed(pq.data)
            recorder.recomputed(pq.scale)

        def weight_grads() -> tuple[torch.Tensor, None]:
            x = dequantize(pq)
            return gemm(quantize_tiles(dy.t()), quantize_tiles(x.t())), None

        store = WeightGradStore.active()
        if store is not None and _deferrable(weight, True):
            store.put_grads((weight, None), weight_grads)
            return (*grads, None, None, None)
        return (*grads, weight_grads()[0].to(weight.dtype), None, None)


def fp8_swiglu_down(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None,
                    down: FP8Linear) -> torch.Tensor:
    """``down(silu(gate) * up [* row_weight])`` keeping only FP8 gate and up for backward (see
    ``_FP8SwiGLUDownFunction``); ``down`` must be a bias-free ``FP8Linear``."""
    if down.bias is not None:
        raise ValueError("fp8_swiglu_down needs a down-projection without bias")
    _, gemm = resolve_gemm(gate.device, down.backend)
    return _FP8SwiGLUDownFunction.apply(gate, up, row_weight, down.weight, down.quantized_weight(), gemm)
