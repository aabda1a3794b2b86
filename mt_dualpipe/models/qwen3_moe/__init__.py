"""Qwen3-MoE for mt_dualpipe: model, pipeline stages for any placement, Hugging Face checkpoints.

    model = Qwen3MoeForCausalLM.from_pretrained(path)          # or mt_dualpipe.models.from_pretrained(path)
    mods = stages_for_rank(config, schedule, rank, checkpoint=path)   # reads only this rank's tensors
    loss = pipe.step(tokens, criterion=criterion_for(mods), labels=(labels,), ...)
    save_pipeline_checkpoint(mods, path)                       # every rank; one HF checkpoint

Composed only of ``mt_dualpipe.layers``; no other family is imported.
"""

from ..hf_checkpoint import save_pipeline_checkpoint
from .config import MODEL_TYPE, Qwen3MoeConfig
from .model import Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM
from .stages import Qwen3MoeStage, build_stages, criterion_for, stage_layer_ids, stages_for_rank

__all__ = [
    "MODEL_TYPE", "Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "Qwen3MoeStage", "build_stages",
    "criterion_for", "save_pipeline_checkpoint", "stage_layer_ids", "stages_for_rank",
]
