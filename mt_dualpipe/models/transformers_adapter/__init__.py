"""Any transformers decoder-only causal LM without a native family, as pipeline stages of its own modules.

``AdaptedCausalLM.from_pretrained(path)`` (what ``mt_dualpipe.from_pretrained`` returns for such a model) loads it
with transformers; ``stages_for_rank(config, schedule, rank, source=model | checkpoint=path)`` cuts it into the
schedule's stages (``AdaptedStage``: transformers' embedding, layers, norm and head, with positions, rotary
embeddings and masks rebuilt on each stage); ``criterion_for(stages)`` is the library's loss. What it takes and
refuses: ``support.py``; the docs: ``docs/models.md``, section "Any transformers decoder-only model".
"""

from .config import AdaptedConfig
from .model import AdaptedCausalLM
from .stages import AdaptedStage, build_stages, criterion_for, stages_for_rank
from .support import TAKES, AdapterError, check_adaptable, refusal, refusal_of

__all__ = ["AdaptedCausalLM", "AdaptedConfig", "AdaptedStage", "AdapterError", "build_stages", "check_adaptable",
           "criterion_for", "refusal", "refusal_of", "stages_for_rank", "TAKES"]
