"""Re-exports ``mt_dualpipe.models.llama.stages`` (the family moved there)."""

from ...models.llama.stages import LlamaStage, build_stages, criterion_for, stage_layer_ids, stages_for_rank

__all__ = ["LlamaStage", "build_stages", "criterion_for", "stage_layer_ids", "stages_for_rank"]
