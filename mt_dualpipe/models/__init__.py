"""Model families on one shared model layer.

``layers`` holds the pieces (norms, RoPE, attention, MLP, router, MoE, embedding and head); each family
(``qwen3_moe``) is one folder that composes them and imports no other family. ``from_pretrained(path)``
reads a Hugging Face folder's ``model_type`` and returns that family's model (``registry.py``), the
existing ``integrations.llama`` and ``integrations.deepseek_v3`` included.
"""

from .registry import FAMILIES, family, from_pretrained, model_type_of, register_family

__all__ = ["FAMILIES", "family", "from_pretrained", "model_type_of", "register_family"]
