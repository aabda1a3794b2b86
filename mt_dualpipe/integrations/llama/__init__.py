"""The Llama family moved to ``mt_dualpipe.models.llama`` (it composes the shared ``mt_dualpipe.layers``
like every family); this package re-exports it so ``from mt_dualpipe.integrations.llama import ...`` and
its submodules (``config``, ``model``, ``checkpoint``, ``stages``) keep working. It holds no code: the
import-graph test allows its one upward import only as a compatibility alias (docs/architecture.md).
"""

from ...models.llama import (
    Llama3RopeScaling,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaStage,
    build_stages,
    criterion_for,
    llama3_inv_freq,
    save_pipeline_checkpoint,
    stage_layer_ids,
    stages_for_rank,
    sync_replicas,
)

__all__ = [
    "Llama3RopeScaling", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "LlamaStage",
    "build_stages", "criterion_for", "llama3_inv_freq", "save_pipeline_checkpoint", "stage_layer_ids",
    "stages_for_rank", "sync_replicas",
]
