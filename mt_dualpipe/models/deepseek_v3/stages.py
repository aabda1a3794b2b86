"""DeepSeek-V3 cut into pipeline stages, and which stages each rank runs.

A stage holds a contiguous run of blocks; the first also holds the embedding, the last the final
norm, the output head and the MTP modules (plus the embedding MTP reads: on a rank that also holds the
first stage, ``stages_for_rank`` makes the two one module, ``share_local_embedding``; elsewhere a copy).
Parameter names are the full model's, so ``load_from`` copies weights by key.

Replicas of one weight, and who sums them: a stage that holds the embedding declares
``tied_parameters = ("model.embed_tokens.weight",)``; any ``Pipeline`` over these stages then sums every copy of
that weight (first and last stage, on any rank; a parameter two local stages share counts once) and
DualPipe's mirrored stage copies once per
step, and with ``mesh=`` also averages the data/expert-parallel replicas in the same pass (routed
experts are weight kind "expert": reduced over dp only, ``layers.moe_state.mark_expert_weights``).
``sync_expert_load`` sums the routed-token counts the auxiliary-loss-free bias update reads, over
every rank that routes tokens through a layer. ``sync_replicas`` is the older by-name sum, for
loops that run stage modules without a ``Pipeline``.

The runtime contract: ``stage(*inputs)`` takes the previous stage's outputs (token ids on the
first stage) and returns the hidden states; the last stage's ``criterion(hidden, labels)`` returns
the training loss (main + λ·MTP; the MoE balance loss enters through its gradient). Packed documents
(``layers/documents.py``): the first stage takes ``(ids, position_ids)``, every stage returns
``(hidden, position_ids)`` (an int32 copy, ``hand_on``) and the criterion is called ``criterion(hidden,
position_ids, labels)``: MTP needs them to stay inside each document (``model.language_model_losses``).
DualPipe's F&B units overlap the MoE all-to-alls through the shared dispatcher's overlap points
(``runtime/overlap.py``): no stage code of its own.

Stages are built with ``DeferredLinear`` layers by default (``defer_weight_grads=True``): under a
zero-bubble schedule B then computes only input gradients (plus the cheap norm, gate and embedding
weight gradients) and W runs the linears' weight-gradient GEMMs. Same parameters, state dict and
results as ``nn.Linear``; the single-process ``DeepSeekV3Model`` stays plain.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...fp8 import convert_to_fp8
from ...layers.documents import criterion_inputs
from ...layers.expert_parallel import mesh_ep_group
from ...layers.moe_state import mark_expert_weights
from ...layers.replicas import parameter_grads, sum_copies
from ...parallel.device import collective_device
from ...schedules.placements import make_placement
from ...schedules.registry import has_fb_units
from ..decoder_stage import DecoderStage, build_stage_list
from .checkpoint import build_loaded, hf_state_dict
from .config import DeepSeekV3Config
from .hf_names import is_fp8_weight, is_fp32_weight
from .layout import stage_layer_ids
from .model import (
    DeepSeekV3Decoder,
    DeepSeekV3Model,
    LossParts,
    deferred_init,
    expert_load_names,
    init_weights,
    language_model_losses,
    mtp_modules,
)
from .stage_balance import balanced_layout


class DeepSeekV3Stage(DecoderStage):
    """One pipeline stage of DeepSeek-V3 (see the module docstring for the contract): a ``DecoderStage``
    whose last stage holds a declared extra, the MTP depths ``mtp``, which read the embedding too."""

    extras = ("mtp",)

    def __init__(self, config: DeepSeekV3Config, index: int, num_stages: int, layer_ids: Sequence[int],
                 ep_group: dist.ProcessGroup | None = None, defer_weight_grads: bool = True) -> None:
        super().__init__(config, index, num_stages)
        self.loss_log: list[tuple[float, list[float]]] = []  # type: ignore[assignment]  # (main, [mtp_k]) per call
        with deferred_init():
            self.model = DeepSeekV3Decoder(config, layer_ids, ep_group, embed=self.holds_embedding, norm=self.is_last)
            if self.is_last:
                self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
                self.mtp = mtp_modules(config, ep_group)
        init_weights(self, config.init_std)
        # The MTP modules read the main embedding: the first and the last stage each hold it (one module when
        # both are on one rank: share_local_embedding; else copies whose gradients the pipeline sums). The head
        # lives on the last stage only: nothing else is tied.
        self.finish_init(defer_weight_grads)

    @property
    def last_reads_embedding(self) -> bool:
        return self.config.mtp_depth > 0

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under their Hugging Face checkpoint names (``save_pipeline_checkpoint``)."""
        return hf_state_dict(self, self.config)

    fp8_checkpoint_names = staticmethod(is_fp8_weight)
    fp32_checkpoint_names = staticmethod(is_fp32_weight)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    # ----- loss (last stage) -----------------------------------------------------------------------
    def losses(self, h: torch.Tensor, labels: torch.Tensor, normalizer: Sequence[float] | None = None,
               position_ids: torch.Tensor | None = None) -> LossParts:
        if not self.is_last:
            raise RuntimeError(f"{self.extra_repr()} is not the last stage: it has no head or loss")
        return language_model_losses(h, labels, embed=getattr(self.model, "embed_tokens", None), norm=self.model.norm,
                                     head=self.lm_head, mtp=self.mtp, config=self.config, normalizer=normalizer,
                                     position_ids=position_ids)

    def criterion(self, h: torch.Tensor, *rest: torch.Tensor,  # type: ignore[override]
                  normalizer: Sequence[float] | None = None) -> torch.Tensor:
        """The runtime's ``criterion(*outputs, *labels)``: ``(h, labels)``, or for packed rows ``(h, position_ids,
        labels)`` (the last stage returns its position ids too); main + λ·MTP loss; logs the parts.
        ``normalizer`` (``model.step_normalizers``, with the step's ``position_ids`` for packed rows): each loss
        summed over the step's count of its valid targets."""
        position_ids, labels = criterion_inputs(rest, self.extra_repr())
        parts = self.losses(h, labels, normalizer, position_ids)
        self.loss_log.append((float(parts.main.detach()), [float(m.detach()) for m in parts.mtp]))
        return parts.total


# ----- building and placing stages -------------------------------------------------------------------
def build_stages(config: DeepSeekV3Config, num_stages: int, layout: Sequence[int] | str | None = None, *,
                 source: DeepSeekV3Model | None = None, indices: Sequence[int] | None = None,
                 ep_group: dist.ProcessGroup | None = None, defer_weight_grads: bool = True,
                 checkpoint: Any = None, fp8: bool = False, recompute: str = "none",
                 compile: bool | str = False) -> list[DeepSeekV3Stage]:
    """The stage modules (all, or only ``indices``), weights copied from ``source`` when given.

    ``recompute``: ``"none"``, ``"selective"`` or ``"full"`` (``models/recompute.py``).
    ``compile``: True (inductor) or a backend name compiles each block's memory-bound parts, its
    linears kept out of the graph so the split still defers their weight GEMMs (``models/compile.py``).

    ``defer_weight_grads``: build the linears as ``DeferredLinear`` (the zero-bubble B/W split).
    ``checkpoint`` (a Hugging Face checkpoint folder or ``hf_checkpoint.Checkpoint``): each stage is
    built on the meta device and reads only its own tensors (with ``ep_group``: only its experts);
    ``fp8`` converts the linears to ``FP8Linear`` (``convert_to_fp8``; before a checkpoint is read, so
    its FP8 weights and block scales are kept as stored)."""
    ids = stage_layer_ids(config, num_stages, layout)
    stages = build_stage_list(
        lambda i: DeepSeekV3Stage(config, i, num_stages, ids[i], ep_group, defer_weight_grads),
        range(num_stages) if indices is None else indices, source=source, checkpoint=checkpoint,
        load=lambda make, ckpt: build_loaded(make, ckpt, config, fp8=fp8), prepare=convert_to_fp8 if fp8 else None,
        recompute=recompute, compile=compile)
    for st in stages:
        mark_expert_weights(st)  # again: checkpoint loading and FP8 conversion may have made new Parameters
    return stages  # type: ignore[return-value]


def dualpipe_stage_ids(rank: int, num_ranks: int) -> tuple[int, int]:
    """DualPipe: rank r holds stage r of one direction and stage P−1−r of the other (P stages)."""
    _check_rank(rank, num_ranks)
    return tuple(s for _, s in make_placement("dual", num_ranks, 2).local_stages(rank))


def v_stage_ids(rank: int, num_ranks: int) -> tuple[int, int]:
    """V schedules (DualPipeV, ZB-V): rank r holds stages r and 2P−1−r of 2P stages."""
    _check_rank(rank, num_ranks)
    return tuple(s for _, s in make_placement("v", num_ranks, 1).local_stages(rank))


def _check_rank(rank: int, num_ranks: int) -> None:
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside 0..{num_ranks - 1}")


def stages_for_rank(config: DeepSeekV3Config, schedule: Any, rank: int, layout: Sequence[int] | str | None = None,
                    *, source: DeepSeekV3Model | None = None,
                    ep_group: dist.ProcessGroup | None = None, mesh: Any = None,
                    defer_weight_grads: bool = True, checkpoint: Any = None, fp8: bool = False,
                    recompute: str = "none", compile: bool | str = False,
                    share_embedding: bool = True, seq_len: int | None = None) -> list[DeepSeekV3Stage]:
    """This rank's stage modules for any schedule, in ``schedule.local_stages(rank)`` order (the order the
    runtime expects). Mirrored chains (DualPipe) map chain c's stage s to the same model stage s.
    ``share_embedding``: where this rank holds both the first stage and the last (DualPipe, DualPipeV,
    ZB-V: rank 0), MTP reads the main embedding itself (``share_local_embedding``), one parameter, as the
    DeepSeek-V3 report has it; pass False when each stage is wrapped with ``fully_shard`` on its own.
    ``layout`` None: ``stage_balance.balanced_layout`` for the schedule's placement (per-rank modelled cost;
    under DualPipe's F&B units no stage is left without a block beside a partner holding MoE blocks)
    at ``seq_len`` tokens per sequence (default ``config.max_seq_len``): the cut ``mt-dualpipe plan``
    assumes for a run at that sequence length (``planner.stage_cut``).
    ``mesh`` (``parallel.ParallelDims``): the routed experts are sharded over its ep group
    (``layers.expert_parallel.mesh_ep_group``) and ``rank`` must be this process's pp coordinate."""
    if mesh is not None:
        if ep_group is not None:
            raise ValueError("give stages_for_rank mesh= (the experts then shard over its ep group) or ep_group=, "
                             "not both")
        if rank != mesh.coord("pp"):
            raise ValueError(f"rank {rank} is not this process's pipeline rank on the mesh ({mesh.coord('pp')})")
        ep_group = mesh_ep_group(mesh)
    num_stages = schedule.num_stages(0)
    if layout is None:
        layout = balanced_layout(config, schedule.placement, seq_len, fb_units=has_fb_units(schedule.name))
    wanted = [s for _, s in schedule.local_stages(rank)]
    stages = build_stages(config, num_stages, layout, source=source, indices=wanted, ep_group=ep_group,
                          defer_weight_grads=defer_weight_grads, checkpoint=checkpoint, fp8=fp8, recompute=recompute,
                          compile=compile)
    if share_embedding:
        share_local_embedding(stages)
    return stages


def share_local_embedding(stages: Sequence[DeepSeekV3Stage]) -> int:
    """Make every local stage that holds the embedding (the first stage's, the last stage's MTP input)
    use one ``nn.Embedding``: one parameter, whose gradient autograd sums over both uses, counted once in
    memory (the DeepSeek-V3 report shares it physically between the main model and MTP). Copies whose
    values differ (weights loaded into the stages separately, then changed on one) are left as they
    are, tied by the runtime; stages on the meta device share (both are filled from the checkpoint's one
    ``model.embed_tokens.weight``: the MTP layer's copy is not read, ``hf_names.from_hf_name``). Returns
    how many copies now share. The runtime's tie of ``model.embed_tokens.weight`` with other
    ranks' copies counts a shared parameter once (``TiedSync``)."""
    holders = [st for st in stages if hasattr(st.model, "embed_tokens")]
    shared = 0
    for st in holders[1:]:
        one = holders[0].model.embed_tokens
        if st.model.embed_tokens is one:
            continue
        if st.model.embed_tokens.weight.shape == one.weight.shape and _same_values(st.model.embed_tokens.weight,
                                                                                  one.weight):
            st.model.embed_tokens = one
            shared += 1
    return shared


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values; on the meta device (shapes only, filled later from one checkpoint key) always."""
    return a.is_meta or b.is_meta or torch.equal(a.detach(), b.detach())


def criterion_for(stages: Sequence[DeepSeekV3Stage], normalizer: Sequence[float] | None = None):
    """The bound criterion of the last stage among this rank's stages, or None if it has none; with
    ``normalizer`` (``model.step_normalizers(labels, config.mtp_depth)``) bound to it."""
    last = [st for st in stages if st.is_last]
    if not last:
        return None
    return last[0].criterion if normalizer is None else functools.partial(last[0].criterion, normalizer=normalizer)


# ----- replicas: mirrored stages, the MTP embedding copy, data/expert-parallel copies -------------------
def _local_tensors(modules: Sequence[nn.Module], what: str) -> dict[str, list[torch.Tensor]]:
    if what == "grads":  # a parameter two local stages share (the embedding) is one copy
        return parameter_grads(modules)
    if what != "load":
        raise ValueError(f"what must be 'grads' or 'load', got {what!r}")
    out: dict[str, list[torch.Tensor]] = {}
    for m in modules:
        for name, b in m.named_buffers():
            if name.endswith("gate.load"):
                out.setdefault(name, []).append(b)
    return out


@torch.no_grad()
def sync_expert_load(modules: Sequence[nn.Module], dims: Any = None) -> None:
    """Sum each MoE layer's routed-token counts (``gate.load``) over every rank that routes tokens through it.

    Those are the layer's copies on this rank, its DualPipe mirror and its data- and expert-parallel
    replicas: all ranks of the mesh holding the layer. One ``all_reduce`` over the world of a
    (MoE layers x experts) buffer laid out by ``expert_load_names`` (ranks without a layer add
    zeros) gives exactly that sum on every holder, whatever the schedule's placement, with no
    group to build or rebuild. ``dims`` (``parallel.ParallelDims``): the mesh; its tensor-parallel
    ranks route the same tokens, so the sum is divided by ``tp``. Without ``dims`` (or without an
    initialised process group) only this rank's copies are summed. Collective: every rank calls it,
    before ``update_expert_bias`` (so every replica moves its bias identically).
    """
    modules = list(modules)
    if not modules:
        raise ValueError("sync_expert_load needs this rank's stage modules, got none")
    names = expert_load_names(modules[0].config)
    index = {n: i for i, n in enumerate(names)}
    local = [(index[n], b) for m in modules for n, b in m.named_buffers() if n in index]
    width = modules[0].config.n_routed_experts
    # nccl reduces device tensors: where this rank's weights are, or the collective's device for a rank whose
    # stages hold none (pass-through stages at a depth the model barely fills)
    held = next((t.device for m in modules for t in (*m.parameters(), *m.buffers())), None)
    device = held if held is not None else collective_device()
    flat = torch.zeros(len(names), width, dtype=local[0][1].dtype if local else torch.float32, device=device)
    for i, b in local:
        flat[i] += b
    if dims is not None and dist.is_initialized():
        dist.all_reduce(flat)
        flat /= dims.tp
    for i, b in local:
        b.copy_(flat[i])


@torch.no_grad()
def sync_replicas(modules: Sequence[nn.Module], group: dist.ProcessGroup | None = None, what: str = "grads") -> None:
    """Sum every tensor over all copies of the same parameter name, on this rank and across ``group``.

    Deprecated for gradients after a ``Pipeline`` step: the stages declare ``tied_parameters``, so
    any ``Pipeline`` (mesh or not) sums the tied embedding's copies and DualPipe's mirrored copies
    in its step (and, with ``mesh=``, the data/expert-parallel replicas); summing again here would
    count them twice. ``what="grads"`` is for loops that run stage modules without a ``Pipeline``;
    ``what="load"`` for a loop without a mesh (with one, ``sync_expert_load``).

    ``what="grads"`` after backward (DualPipe's mirrored stages, the MTP embedding copy, data- and
    expert-parallel replicas); ``what="load"`` before ``update_expert_bias``. Without a process
    group only this rank's copies are summed. Every rank of ``group`` must call it.
    """
    sum_copies(_local_tensors(modules, what), group)
