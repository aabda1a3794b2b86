"""LLaVA for mt_dualpipe: a CLIP or SigLIP vision tower, a projector and a Llama, with pipeline stages.

    model = LlavaForConditionalGeneration.from_pretrained(path)   # or mt_dualpipe.models.from_pretrained(path)
    logits = model(input_ids, pixel_values=pixels)                # pixels: (batch, max_images, C, H, W)
    mods = stages_for_rank(config, schedule, rank, checkpoint=path)  # the vision tower lives on stage 0
    loss = pipe.step(input_ids, pixels, criterion=criterion_for(mods, normalizer=n), labels=(labels,), ...)
    save_pipeline_checkpoint(mods, path)                          # every rank; one HF checkpoint

Composed only of ``mt_dualpipe.layers``; no other family is imported. Files: ``config.py`` (sizes, HF
config), ``vision.py`` (tower, projector), ``text.py`` (Llama), ``inputs.py`` (batch layout, labels),
``model.py``, ``checkpoint.py`` (key layouts), ``stages.py``, ``balance.py`` (layout with the encoder
on stage 0), ``spec.py`` (the planner's description).
"""

from ..hf_checkpoint import save_pipeline_checkpoint
from .balance import balanced_layout
from .checkpoint import KeyLayout
from .config import MODEL_TYPE, LlavaConfig, TextConfig, VisionConfig
from .inputs import IGNORE_INDEX, image_counts, next_token_labels
from .model import LlavaForConditionalGeneration
from .stages import LlavaStage, build_stages, criterion_for, stage_layer_ids, stages_for_rank
from .text import LlamaDecoderLayer
from .vision import VisionTower

__all__ = [
    "IGNORE_INDEX", "MODEL_TYPE", "KeyLayout", "LlamaDecoderLayer", "LlavaConfig", "LlavaForConditionalGeneration",
    "LlavaStage", "TextConfig", "VisionConfig", "VisionTower", "balanced_layout", "build_stages", "criterion_for",
    "image_counts", "next_token_labels", "save_pipeline_checkpoint", "stage_layer_ids", "stages_for_rank",
]
