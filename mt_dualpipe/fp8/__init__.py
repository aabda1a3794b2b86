"""FP8 layers with DeepSeek-V3's block-wise recipe and deferred (zero-bubble W) weight gradients.

``FP8Linear`` is a drop-in ``nn.Linear``; ``convert_to_fp8(model)`` swaps a model's linears while
keeping the embedding, output head, MoE gate, norms and attention core in high precision;
``backend_summary(device)`` says which GEMM runs (block-scaled ``scaled_mm`` or the emulation).
An FP8 checkpoint's E4M3 weight and 128×128 ``weight_scale_inv`` (the released DeepSeek-V3 format, the
same layout as ``quantize_blocks``) go straight in with ``FP8Linear.load_quantized`` (no re-quantisation);
the model loaders (``from_pretrained(..., fp8=True)``, ``build_stages(..., checkpoint=, fp8=True)``) do so.
"""

from .backends import BACKENDS, backend_summary, emulated_gemm, probe_scaled_mm, resolve_gemm
from .convert import DEFAULT_SKIP, ENGINES, TransformerEngineLinear, convert_to_fp8, skip_predicate
from .linear import FP8Linear
from .quantize import AMAX_FLOOR, E4M3, E4M3_MAX, TILE, QTensor, dequantize, quantize_blocks, quantize_tiles

__all__ = [
    "AMAX_FLOOR", "BACKENDS", "DEFAULT_SKIP", "E4M3", "E4M3_MAX", "ENGINES", "FP8Linear", "QTensor", "TILE",
    "TransformerEngineLinear", "backend_summary", "convert_to_fp8", "dequantize", "emulated_gemm",
    "probe_scaled_mm", "quantize_blocks", "quantize_tiles", "resolve_gemm", "skip_predicate",
]
