"""Dense Llama 3 family: model, pipeline stages for any placement, Hugging Face checkpoints, FP8.

    config = LlamaConfig.preset("tiny")                      # or "8b", or LlamaConfig.from_hf(path)
    model = LlamaForCausalLM(config)                         # single-process reference
    mods = stages_for_rank(config, schedule, rank, source=model)   # or checkpoint=path (per-stage read)
    loss = pipe.step(tokens, criterion=criterion_for(mods, normalizer=step_normalizer(labels)), ...)
    sync_replicas(mods, group)                               # tied embeddings / mirrored stages, no Pipeline
    save_pipeline_checkpoint(mods, path)                     # every rank; one HF checkpoint

Composed only of ``mt_dualpipe.layers``; no other family is imported. ``mt_dualpipe.models.llama``
re-exports these names for code written before the family moved here. FP8: ``build_stages(..., fp8=True)``
or ``convert_to_fp8(model)``.
"""

from ...layers.replicas import sync_replicas
from ..hf_checkpoint import save_pipeline_checkpoint
from .config import Llama3RopeScaling, LlamaConfig
from .model import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, llama3_inv_freq
from .stages import LlamaStage, build_stages, criterion_for, stage_layer_ids, stages_for_rank

__all__ = [
    "Llama3RopeScaling", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "LlamaStage",
    "build_stages", "criterion_for", "llama3_inv_freq", "save_pipeline_checkpoint", "stage_layer_ids",
    "stages_for_rank", "sync_replicas",
]
