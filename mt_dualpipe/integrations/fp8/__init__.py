"""FP8 layers with DeepSeek-V3's block-wise recipe and deferred (zero-bubble W) weight gradients.

``FP8Linear`` is a drop-in ``nn.Linear``; ``convert_to_fp8(model)`` swaps a model's linears while
keeping the embedding, output head, MoE gate, norms and attention core in high precision;
``backend_summary(device)`` says which GEMM runs (block-scaled ``scaled_mm`` or the emulation).
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
