"""Re-exports ``mt_dualpipe.models.llama.checkpoint`` (the family moved there)."""

from ...models.llama.checkpoint import build_loaded, is_fp8_weight, open_checkpoint, save_weights

__all__ = ["build_loaded", "is_fp8_weight", "open_checkpoint", "save_weights"]
