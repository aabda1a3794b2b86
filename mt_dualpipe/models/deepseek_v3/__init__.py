"""DeepSeek-V3 for mt_dualpipe: the model (MLA, DeepSeekMoE, MTP), its pipeline stages, expert
parallelism over all-to-all (the shared layer's dispatcher, whose all-to-alls DualPipe's F&B units overlap).

On each rank of a pp x dp x ep mesh (see ``examples/deepseek_v3_repro.py`` for the whole loop)::

    dims = init_parallel(pp=P, dp=D, ep=E)             # mt_dualpipe.parallel
    config = DeepSeekV3Config.preset("tiny")
    torch.manual_seed(0)
    full = DeepSeekV3Model(config)                     # the single-process reference
    sched = build_schedule("dualpipe", P, M)
    mods = stages_for_rank(config, sched, dims.coord("pp"), source=full, mesh=dims)   # experts over dims' ep
    pipe = DualPipe(tuple(mods), mesh=dims, dp_mode="zero1", dp_batch="local")
    opt = pipe.build_optimizer(lambda params: torch.optim.AdamW(params, lr=3e-3))
    loss, _ = pipe.step(tokens, num_chunks=M, criterion=criterion_for(mods), labels=(labels,))
    opt.step(); opt.zero_grad()        # the step already summed mirrored copies, the tied embedding, replicas
    sync_expert_load(mods, dims); update_expert_bias(nn.ModuleList(mods))   # layers.moe_state

Routed experts are weight kind "expert" (reduced over dp only), the rest "dense" (over dp x ep);
stages holding the embedding declare it in ``tied_parameters`` (the MTP modules share it).
Modules carry the Hugging Face checkpoint's names (``model.layers.N.self_attn.q_a_proj``, ``lm_head``, ...);
the MTP depths, the last stage's declared extra, are ``mtp.{k}`` (``hf_names``: layer ``n_layers + k``);
``DeepSeekV3Stage`` is a ``DecoderStage``.
``sync_replicas(mods, group)`` sums copies by name, for loops that run stages without a ``Pipeline``.

Real checkpoints (Hugging Face layout, incl. the released FP8 one): ``DeepSeekV3Config.from_hf(path)``,
``DeepSeekV3Model.from_pretrained(path)`` / ``save_pretrained(path)``, per-stage
``stages_for_rank(..., checkpoint=path)`` and ``models.hf_checkpoint.save_pipeline_checkpoint(mods, path)``
from all ranks. The MoE helpers every family shares (expert load, bias update, EP groups) live in
``layers.moe_state`` and ``layers.expert_parallel``.
"""

from .config import DeepSeekV3Config
from .layout import parse_layout, stage_layer_ids
from .model import (
    Block,
    DeepSeekV3Model,
    LossParts,
    MTPModule,
    expert_load_names,
    language_model_losses,
    mtp_targets,
    step_normalizers,
)
from .moe import moe_block
from .stages import (
    DeepSeekV3Stage,
    build_stages,
    criterion_for,
    dualpipe_stage_ids,
    share_local_embedding,
    stages_for_rank,
    sync_expert_load,
    sync_replicas,
    v_stage_ids,
)
from .yarn import YarnScaling

__all__ = [
    "Block", "DeepSeekV3Config", "DeepSeekV3Model", "DeepSeekV3Stage", "LossParts", "MTPModule",
    "build_stages", "criterion_for", "dualpipe_stage_ids", "expert_load_names", "language_model_losses",
    "moe_block", "mtp_targets", "parse_layout", "share_local_embedding", "stage_layer_ids", "stages_for_rank",
    "step_normalizers", "sync_expert_load", "sync_replicas", "v_stage_ids", "YarnScaling",
]
