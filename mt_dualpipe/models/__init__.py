"""Model families on one shared model layer.

``layers`` holds the pieces (norms, RoPE, attention, MLP, router, MoE, embedding and head); each family
(``llama``, ``qwen3_moe``, ``llava``) is one folder that composes them and imports no other family.
``from_pretrained(path)`` reads a Hugging Face folder's ``model_type`` and returns that family's model
(``registry.py``), ``models.deepseek_v3`` included; ``planner_model(name)`` gives the planner a family
preset's ``ModelSpec`` (``planner_specs.py``).
"""

from .planner_specs import planner_model, planner_names
from .registry import FAMILIES, Family, family, from_pretrained, model_type_of, register_family

__all__ = ["FAMILIES", "Family", "family", "from_pretrained", "model_type_of", "planner_model", "planner_names",
           "register_family"]
