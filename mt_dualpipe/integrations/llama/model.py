"""Re-exports ``mt_dualpipe.models.llama.model`` (the family moved there; its attention and MLP are now the
shared ``layers.GQAttention`` and ``layers.SwiGLUMLP``)."""

from ...models.llama.model import (
    LlamaBody,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    init_llama,
    llama3_inv_freq,
)

__all__ = ["LlamaBody", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "init_llama", "llama3_inv_freq"]
