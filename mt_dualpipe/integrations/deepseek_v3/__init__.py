"""DeepSeek-V3 for mt_dualpipe: the model (MLA, DeepSeekMoE, MTP), its pipeline stages, expert
parallelism over all-to-all, and the overlapped forward/backward DualPipe pairs with.

On each rank (see ``examples/deepseek_v3_repro.py`` for the whole loop)::

    config = DeepSeekV3Config.preset("tiny")
    torch.manual_seed(0)
    full = DeepSeekV3Model(config)                     # the single-process reference
    sched = build_schedule("dualpipe", P, M)
    mods = stages_for_rank(config, sched, rank, source=full)   # (stage r, stage P-1-r)
    pipe = DualPipe(tuple(mods))
    loss, _ = pipe.step(tokens, num_chunks=M, criterion=criterion_for(mods), labels=(labels,))
    sync_replicas(mods, dist.group.WORLD)              # mirrored copies + the MTP embedding copy
    opt.step(); opt.zero_grad()
    sync_replicas(mods, dist.group.WORLD, what="load"); update_expert_bias(nn.ModuleList(mods))

Real checkpoints (Hugging Face layout, incl. the released FP8 one): ``DeepSeekV3Config.from_hf(path)``,
``DeepSeekV3Model.from_pretrained(path)`` / ``save_pretrained(path)``, per-stage
``stages_for_rank(..., checkpoint=path)`` and ``save_pipeline_checkpoint(mods, path)`` from all ranks.
"""

from ..hf_checkpoint import Checkpoint, CheckpointError, save_pipeline_checkpoint
from .config import DeepSeekV3Config, YarnScaling
from .model import Block, DeepSeekV3Model, LossParts, MTPModule, language_model_losses
from .moe import MoE, dropped_fraction, max_violation, set_aux_loss_scale, update_expert_bias
from .stages import (
    DeepSeekV3Stage,
    build_stages,
    criterion_for,
    dualpipe_stage_ids,
    parse_layout,
    stage_layer_ids,
    stages_for_rank,
    sync_replicas,
    v_stage_ids,
)

overlapped_forward_backward = DeepSeekV3Stage.overlapped_forward_backward

__all__ = [
    "Block", "DeepSeekV3Config", "DeepSeekV3Model", "DeepSeekV3Stage", "LossParts", "MTPModule", "MoE",
    "build_stages", "criterion_for", "dropped_fraction", "dualpipe_stage_ids", "language_model_losses", "max_violation",
    "overlapped_forward_backward", "parse_layout", "set_aux_loss_scale", "stage_layer_ids", "stages_for_rank",
    "sync_replicas", "update_expert_bias", "v_stage_ids", "Checkpoint", "CheckpointError", "YarnScaling",
    "save_pipeline_checkpoint",
]
