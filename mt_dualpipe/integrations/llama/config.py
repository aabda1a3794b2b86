"""Re-exports ``mt_dualpipe.models.llama.config`` (the family moved there)."""

from ...models.llama.config import Llama3RopeScaling, LlamaConfig

__all__ = ["Llama3RopeScaling", "LlamaConfig"]
