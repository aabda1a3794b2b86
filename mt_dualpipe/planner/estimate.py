"""Step time and peak memory of one parallel strategy: compute/communication model + simulator.

For a strategy (pipeline size, schedule, micro-batches, expert- and data-parallel sizes) on a
system, the model is cut into pipeline stages (as the runtime cuts them where its family has a cut of
its own, ``stage_cut``: DeepSeek-V3; else balanced by compute along the chain), each stage's F, B, W and
all-to-all times come from FLOPs and bytes, and the pipeline part of the step is simulated with
the same simulator as everything else in this library. Around it:

- **step time** = the simulated makespan of the schedule with one data-parallel gradient
  reduction per stage right after its last W/BW (``add_grad_reduction``, priced per stage by
  ``dp_sync.stage_sync_times``: all-reduce for ZeRO-0, a reduce-scatter for ZeRO-1 and FSDP), run
  on each rank's communication stream so the pipeline's drain hides what it can; plus, with
  sharding, the parameters' all-gather once a step (``dp_sync.param_gather_time``, exposed: ZeRO-1's
  after the optimizer step, FSDP's when the next step unshards its stages before any F).
  ``pipeline_time`` is the compute's makespan, ``dp_sync_time`` what the sync adds to it
  (exposed), and ``dp_sync_total`` what it would add with nothing hidden.
- **memory per GPU** (term by term, each with its formula and the code that keeps it:
  ``memory_terms``) = weights + gradients + optimizer state (sharded over data parallel when the
  mode shards it, ``parallel.modes.DataParallelMode.shards_optimizer_state``: ZeRO-1 and FSDP;
  experts are sharded by expert parallel and their optimizer over the expert-data-parallel
  group) + the peak of saved activations along the rank's op order: a stage's bytes per
  micro-batch from its F to its BW, or to its B, after which a deferred W keeps only its linears'
  inputs (``Item.w_act_bytes``) until it runs, and the stage's received input stays until its W
  (at a V's turn, until the previous stage's W too) — the rules the runtime's recorded peak
  follows (``runtime/activation_bytes.py``, ``runtime/stage.py``). The largest rank counts.
  FSDP counts whole weights and gradients, as ZeRO-1 does: the runtime keeps a stage unsharded
  from the step's start to its reduce-scatter (``parallel/fsdp.py``), so the step's peak holds
  them; only between steps are they sharded.

Costs of a stage: F = matmul FLOPs / the achieved rate of the strategy's precision (``SystemSpec.mm_rate``:
per GPU and precision, from published kernel benchmarks; FP8 training keeps the head and the router in
BF16, ``Item.bf16_mm_flops``) + core attention / attention rate (a flash-style core runs the causal half
of the products, an eager one all of them: ``core_work``) + memory-bound bytes / HBM rate (``Item.hbm_bytes``:
norms, residual adds, SwiGLU, MoE permutes, FP8 casts, an eager core's softmax passes over its scores);
B = the input-gradient matmuls (same FLOPs as F's matmuls) + the core attention's backward (2x F's for an
eager core, 2.5x for a flash-style one, which rebuilds its scores: ``FLASH_BACKWARD``) + 2x the memory-bound
bytes; W = the weight-
gradient matmuls (same FLOPs again). With tensor parallelism (``Strategy.tp``, Megatron-style with
sequence parallelism) all of it is divided over the group and each decoder layer adds its collectives
(``tp_collective_time``: 4 in F, 6 in B); weights, gradients, optimizer state and saved activations are
divided by ``tp`` (experts by ``ep``). DualPipe with an all-to-all to hide runs its compute on the SMs the
communication leaves (``SystemSpec.overlap_share``, 112 of 132 on H800). The optimizer step
(``optimizer_step_time``, memory-bound) follows the sync and is part of ``step_time``
(``Estimate.optimizer_time``); ``Costs.recompute`` = the forward FLOPs the recompute policy
re-runs (``Item.recompute_*``: selective = the recomputed pieces, full = the whole layer but the
router), which the simulator adds once to each B/BW (W reuses what B recomputed).
All-to-all per MoE layer: dispatch (1 byte/element with FP8,
else 2) and combine (2 bytes), each top-k copy crossing NVLink, and the node-deduplicated copies
crossing InfiniBand when the expert-parallel group spans nodes; forward and backward move the same
bytes. The point-to-point hop sends one micro-batch's hidden states.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..parallel.modes import mode_for_zero_stage
from ..schedules import Costs, add_grad_reduction, build_schedule, schedule_info
from ..schedules.errors import ScheduleError
from ..schedules.fuse import executed_schedule
from ..schedules.ir import Schedule
from ..schedules.ops import OpKind, needs, parts, rule
from ..schedules.placements import balanced_cuts
from ..schedules.simulate import SimResult, run_schedule
from .activations import FP8_LIN, active_savers
from .dp_sync import param_gather_time, stage_sync_times
from .families import family_of
from .memory_terms import MemoryTerm, memory_terms, totals, weight_bytes
from .model import Item, ModelSpec
from .runnable import launch, unrunnable_reasons
from .stage_cut import balanced_counts, cuts_per_rank
from .strategy import AUTO, Strategy, schedule_options
from .system import SystemSpec

__all__ = ["AUTO", "GB", "Estimate", "Strategy", "activation_peak_bytes", "estimate", "memory_breakdown",
           "schedule_options", "stage_costs", "stage_items", "weight_bytes"]

GB = 1e9


@dataclass
class Estimate:
    strategy: Strategy
    step_time: float
    pipeline_time: float
    dp_sync_time: float
    bubble_rate: float
    memory_gb: dict[str, float]
    peak_activations: int
    stage_layers: list[int]
    mfu: float
    fits: bool
    note: str = ""
    per_rank_gb: list[float] = field(default_factory=list)  # total memory of every pipeline rank
    costs: Costs | None = field(default=None, repr=False)  # dp_sync: each stage's gradient reduction
    dp_sync_total: float = 0.0  # the sync's time with nothing hidden (the most loaded rank's)
    tied_across_stages: bool = False  # the model ties weights across pipeline stages (MTP's embedding)
    optimizer_time: float = 0.0  # the optimizer step (memory-bound, after the sync; part of step_time)
    memory_rank: int = 0  # the pipeline rank whose memory ``memory_gb`` reports (the fullest)
    blocks_per_stage: list[int] = field(default_factory=list)  # decoder layers per stage (``stage_layers``
    #                                                            counts the embedding and head items too)
    memory_terms: list[MemoryTerm] = field(default_factory=list, repr=False)  # that rank's memory, term by term
    rank_memory: list[dict[str, float]] = field(default_factory=list, repr=False)  # every rank's ``memory_gb``

    @property
    def total_memory_gb(self) -> float:
        return self.memory_gb["total"]

    @property
    def unrunnable(self) -> list[str]:
        """Why the runtime cannot launch this configuration (empty: it can)."""
        return unrunnable_reasons(self.strategy, self.tied_across_stages)

    @property
    def runnable(self) -> bool:
        return not self.unrunnable

    def to_dict(self, memory_savers: Iterable[str] = ()) -> dict:
        """The estimate as JSON data; ``memory_savers``: the plan's savers, which its launch tuple carries."""
        s = self.strategy
        return {"pp": s.pp, "schedule": s.schedule, "placement": s.placement or None,
                "virtual_stages": s.virtual_stages,
                "num_microbatches": s.num_microbatches, "micro_batch_size": s.micro_batch_size, "ep": s.ep,
                "dp": s.dp, "tp": s.tp, "zero": s.zero, "dtype": s.dtype, "recompute": s.recompute,
                "step_time_s": self.step_time, "pipeline_time_s": self.pipeline_time,
                "dp_sync_time_s": self.dp_sync_time, "dp_sync_exposed_s": self.dp_sync_time,
                "dp_sync_total_s": self.dp_sync_total, "optimizer_s": self.optimizer_time,
                "bubble_rate": self.bubble_rate, "mfu": self.mfu,
                "memory_gb": {k: round(v, 3) for k, v in self.memory_gb.items()},
                "peak_activations": self.peak_activations,
                "stage_layers": self.stage_layers, "blocks_per_stage": self.blocks_per_stage,
                "memory_rank": self.memory_rank, "per_rank_gb": [round(x, 3) for x in self.per_rank_gb],
                "memory_terms": [{"part": t.part, "name": t.name, "gb": round(t.gb, 3), "formula": t.formula,
                                  "kept_by": t.kept_by} for t in self.memory_terms],
                "fits": self.fits, "note": self.note,
                "launch": launch(s, memory_savers), "runnable": self.runnable, "unrunnable": self.unrunnable}


# ----- model cut ---------------------------------------------------------------------------------
ACT_UNIT = {"fp8": FP8_LIN, "bf16": 2.0, "fp32": 4.0}  # bytes per cached linear-input element


def item_time(item: Item, tokens: int, system: SystemSpec, dtype: str, tp: int = 1, attention: str = "fused"
              ) -> float:
    """One item's forward seconds on one rank of a ``tp``-way tensor-parallel group: its matmuls at the
    achieved rate of ``dtype``, core attention at BF16's (the work ``attention``'s core runs:
    ``core_work``), memory-bound kernels at the HBM's."""
    attn_rate = system.tflops_bf16 * 1e12 * system.attn_efficiency
    return tokens * (mm_seconds(item, system, dtype) + core_work(attention)[0] * item.attn_flops / attn_rate
                     + item.hbm_bytes / system.hbm_rate()) / tp


def mm_seconds(item: Item, system: SystemSpec, dtype: str) -> float:
    """Seconds per token of an item's forward matmuls: at ``dtype``'s achieved rate, except those FP8 training
    keeps in BF16 (``Item.bf16_mm_flops``: the output head, the router)."""
    if dtype != "fp8":
        return item.mm_flops / system.mm_rate(dtype)
    kept = item.bf16_mm_flops
    return (item.mm_flops - kept) / system.mm_rate(dtype) + kept / system.mm_rate("bf16")


def partition(weights: list[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous groups of ``weights`` minimising the heaviest group (each >= 1 item)."""
    n = len(weights)
    if parts > n:
        raise ScheduleError(f"cannot cut {n} model pieces into {parts} pipeline stages; use fewer stages")
    bounds = balanced_cuts(weights, parts)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def stage_items(model: ModelSpec, strategy: Strategy, system: SystemSpec) -> list[list[Item]]:
    """The model's items cut into the chain's stages: ``strategy.layers_per_stage`` when given, else the
    runtime's own cut where its family has one (``stage_cut.cuts_per_rank``: DeepSeek-V3's
    ``stages_for_rank`` builds ``stage_cut.balance``'s layout for the schedule's placement), else
    balanced by F+B+W time along the chain."""
    items = model.items(strategy.seq_len, ACT_UNIT[strategy.dtype], strategy.recompute,
                        elem=4.0 if strategy.dtype == "fp32" else 2.0, micro_batch_size=strategy.micro_batch_size,
                        attention=strategy.attention)
    tokens = strategy.seq_len * strategy.micro_batch_size
    stages = num_stages(strategy)
    layers_per_stage = strategy.layers_per_stage
    if layers_per_stage is None and cuts_per_rank(model):
        layers_per_stage = tuple(runtime_cut(model, strategy))
    if layers_per_stage is not None:
        layers = list(layers_per_stage)
        if len(layers) != stages or sum(layers) != model.layer_num or min(layers) < 0:
            raise ScheduleError(f"layers_per_stage {layers} must give {stages} counts summing to "
                                f"{model.layer_num} layers")
        sizes = [n + (s == 0) + (s == stages - 1) for s, n in enumerate(layers)]  # + embedding, + head
    else:
        times = [3 * item_time(i, tokens, system, strategy.dtype, strategy.tp, strategy.attention) + 1e-9
                 for i in items]
        sizes = partition(times, stages)
    out, k = [], 0
    for n in sizes:
        out.append(items[k:k + n])
        k += n
    return out


def runtime_cut(model: ModelSpec, strategy: Strategy) -> list[int]:
    """Decoder layers per stage as the runtime cuts them for ``strategy`` (``stage_cut.balance`` over the
    schedule's placement at the strategy's sequence length: ``stages_for_rank(..., seq_len=)``)."""
    info = schedule_info(strategy.schedule)
    placement = info.layout(strategy.pp, strategy.num_microbatches, **schedule_options(strategy))
    return balanced_counts(model, placement.ranks, strategy.seq_len, fb_units=info.fb_units)


def ties_across_stages(model: ModelSpec, stages: int) -> bool:
    """Whether the runtime's stages tie a weight across stages: the MTP modules on the last stage share
    the first stage's embedding (``models/deepseek_v3/stages.py``, ``tied_parameters``)."""
    return model.mtp_depth > 0 and stages > 1


def num_stages(strategy: Strategy) -> int:
    """Stages per chain of the strategy's schedule, from the registry (no schedule is built)."""
    return schedule_info(strategy.schedule).num_stages(strategy.pp, **schedule_options(strategy))


def a2a_time(model: ModelSpec, strategy: Strategy, system: SystemSpec, tokens: int) -> float:
    """Dispatch + combine of one MoE layer for one micro-batch (forward; the backward moves the same)."""
    ep = strategy.ep
    if not model.is_moe or ep <= 1:
        return 0.0
    h, k = model.hidden_size, model.topk
    total = 0.0
    for bytes_per in ((1.0 if strategy.dtype == "fp8" else 2.0), 2.0):  # dispatch, combine
        nodes = -(-ep // system.gpus_per_node)
        bw_intra, lat_intra = system.link(False)
        intra = tokens * k * h * bytes_per * (min(ep, system.gpus_per_node) - 1) / min(ep, system.gpus_per_node)
        t = intra / bw_intra + lat_intra
        if nodes > 1:
            bw_inter, lat_inter = system.link(True)
            fan = min(k, model.max_routed_nodes or k, nodes)
            inter = tokens * h * bytes_per * fan * (nodes - 1) / nodes
            t = max(t, inter / bw_inter + lat_inter)
        total += t
    return total


FLASH_BACKWARD = 2.5
"""A flash-style core's backward in units of its forward: it rebuilds the scores (QKᵀ) from q, k and the
log-sum-exp, then runs dV, dP, dQ and dK: 5 products of the forward's size against the forward's 2 (the
flash-attention repository counts its backward FLOPs as 2.5x the forward's in its benchmarks). An eager core
keeps the probabilities: 4 products, 2x."""
EAGER_CORE_WORK = 2.0
"""The products an eager core runs, in units of the causal FLOPs the model counts (``Item.attn_flops``, half
of QKᵀ and P·V): it computes every score and masks the upper half afterwards (an einsum or Megatron-LM's
``baddbmm``), where a flash-style kernel skips the masked blocks."""


def core_work(attention: str) -> tuple[float, float]:
    """(F, B) work of the core attention in units of ``Item.attn_flops``: a flash-style (``"fused"``) core runs
    the causal half, ``FLASH_BACKWARD`` in B; an eager one the full products (``EAGER_CORE_WORK``), twice in B."""
    if attention == "fused":
        return 1.0, FLASH_BACKWARD
    return EAGER_CORE_WORK, 2 * EAGER_CORE_WORK

TP_FORWARD_COLLECTIVES = 4
"""Megatron-style tensor parallelism with sequence parallelism (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2): per decoder layer the forward
all-gathers the sequence-sharded input before attention's and the MLP's column-parallel linears and
reduce-scatters after their row-parallel linears: 2 all-gathers + 2 reduce-scatters."""
TP_BACKWARD_COLLECTIVES = 6
"""The backward swaps them (4) and all-gathers the two inputs again for the weight gradients, which
sequence parallelism does not keep gathered (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``)."""


def tp_collective_time(model: ModelSpec, strategy: Strategy, system: SystemSpec, tokens: int) -> float:
    """One all-gather or reduce-scatter of a micro-batch's hidden states over the tensor-parallel group:
    each rank sends and receives ``(tp - 1) / tp`` of ``tokens x hidden`` BF16 values (ring), over NVLink
    while the group fits in a node; 0 without tensor parallelism."""
    tp = strategy.tp
    if tp <= 1:
        return 0.0
    bw, lat = system.link(tp > system.gpus_per_node)
    return tokens * model.hidden_size * 2.0 * (tp - 1) / tp / bw + lat


def optimizer_step_time(strategy: Strategy, system: SystemSpec, stages: list[list[Item]], local: list[int]
                        ) -> float:
    """The optimizer step, memory-bound: each parameter the rank steps reads its FP32 gradient and reads and
    writes its master copy and moments (``weight_bytes``' optimizer bytes, twice), then writes the model
    weight; with ZeRO-1 / FSDP a rank steps only its shard. FP8 training re-casts every linear weight to its
    cached E4M3 copy (read ``wb``, write 1 byte), on the whole local copy."""
    wb, gb, ob = weight_bytes(strategy)
    tp = strategy.tp
    dense = sum(i.params for s in local for i in stages[s]) / tp
    expert = sum(i.expert_params for s in local for i in stages[s]) / strategy.ep
    if mode_for_zero_stage(strategy.zero).shards_optimizer_state:
        dense, expert = dense / strategy.dp, expert / max(1, strategy.dp // strategy.ep)
    moved = (dense + expert) * (gb + 2 * ob + wb)
    if strategy.dtype == "fp8":
        linears = sum(i.linear_params for s in local for i in stages[s]) / tp \
            + sum(i.expert_params for s in local for i in stages[s]) / strategy.ep
        moved += linears * (wb + 1)
    return moved / system.hbm_rate()


def overlaps_communication(model: ModelSpec, strategy: Strategy) -> bool:
    """DualPipe's chunks run the all-to-all beside the computation on SMs taken from it (DeepSeek-V3 report,
    section 3.2.2), so its compute runs on ``SystemSpec.overlap_share`` of the SMs when there is an
    all-to-all to overlap."""
    return strategy.schedule in ("dualpipe", "dualpipev") and model.is_moe and strategy.ep > 1


def stage_costs(model: ModelSpec, strategy: Strategy, system: SystemSpec,
                stages: list[list[Item]]) -> Costs:
    """F, B, W seconds of each stage on one rank: matmuls at the achieved rate of the strategy's precision,
    core attention at BF16's, memory-bound kernels at the HBM's (the backward moves twice the forward's
    bytes; W none: its GEMMs read what B left), all divided over the tensor-parallel group, plus its
    collectives (``tp_collective_time``, exposed: nothing overlaps them here); DualPipe's compute slowed to
    the SMs communication leaves it (``overlaps_communication``)."""
    tokens = strategy.seq_len * strategy.micro_batch_size
    tp = strategy.tp
    attn_f, attn_b = core_work(strategy.attention)
    share = system.overlap_share() if overlaps_communication(model, strategy) else 1.0
    attn_rate = system.tflops_bf16 * 1e12 * system.attn_efficiency * tp * share
    hbm_rate = system.hbm_rate() * tp
    a2a = a2a_time(model, strategy, system, tokens)
    coll = tp_collective_time(model, strategy, system, tokens)
    f, b, w, af, rc = [], [], [], [], []
    for group in stages:
        mm = sum(mm_seconds(i, system, strategy.dtype) for i in group) * tokens / (tp * share)
        at = sum(i.attn_flops for i in group) * tokens / attn_rate  # the causal FLOPs; the core runs attn_f x
        mem = sum(i.hbm_bytes for i in group) * tokens / hbm_rate
        layers = sum(1 for i in group if i.attn_flops > 0)
        f.append(mm + attn_f * at + mem + layers * TP_FORWARD_COLLECTIVES * coll)
        b.append(mm + attn_b * at + 2 * mem + layers * TP_BACKWARD_COLLECTIVES * coll)
        w.append(mm)
        af.append(a2a * sum(1 for i in group if i.moe))
        rc.append(sum(i.recompute_mm_flops for i in group) * tokens / (system.mm_rate(strategy.dtype) * tp * share)
                  + attn_f * sum(i.recompute_attn_flops for i in group) * tokens / attn_rate)
    across = strategy.dp * tp >= system.gpus_per_node  # pipeline neighbours sit in different nodes
    bw, lat = system.link(across)
    hop = tokens * model.hidden_size * 2 / tp / bw + lat  # sequence parallel: each rank sends its shard
    # the recomputed forward: the simulator adds it once to each B / BW and to the B half of an FB
    return Costs(f=f, b=b, w=w, comm=hop, a2a_f=af, a2a_b=list(af), recompute=rc if any(rc) else 0.0)


# ----- memory ------------------------------------------------------------------------------------
def planned_rank_peaks(schedule: Schedule, items: list[Item], layer_counts: list[int], tokens: int,
                       hidden_bytes: float) -> list[float]:
    """The planner's peak of saved-activation bytes on every rank of ``schedule`` for a model cut into stages
    of ``layer_counts`` decoder layers (the first stage also the embedding item, the last the head item):
    each stage's saved bytes and its deferred W's share for micro-batches of ``tokens`` tokens, and the
    ``hidden_bytes`` input each stage but the first receives (``activation_peak_bytes``). What a run's
    ``Pipeline.peak_activation_bytes`` (``record_activation_bytes``) is compared with."""
    if sum(layer_counts) + 2 > len(items):
        raise ScheduleError(f"layer counts {layer_counts} need {sum(layer_counts) + 2} items, the model has "
                            f"{len(items)}")
    act, held, k = [], [], 0
    for i, n in enumerate(layer_counts):
        # the first stage also takes the embedding, the last every item to the end (the head, with
        # DeepSeek-V3's MTP riding on it)
        end = len(items) if i == len(layer_counts) - 1 else k + n + (i == 0)
        act.append(sum(it.act_bytes for it in items[k:end]) * tokens)
        held.append(sum(it.w_act_bytes for it in items[k:end]) * tokens)
        k = end
    hidden = [0.0] + [hidden_bytes] * (len(layer_counts) - 1)
    executed = executed_schedule(schedule)  # the runtime runs a B directly followed by its own W as one BW
    return [activation_peak_bytes(executed.ranks[r], act, held, hidden) for r in range(len(executed.ranks))]


def activation_peak_bytes(ops: list, stage_bytes: list[float], w_bytes: list[float] | None = None,
                          input_bytes: list[float] | None = None) -> float:
    """Peak saved-activation bytes of one rank's op order: each op holds and frees what ``schedules.ops``
    says it does (+ its stage's bytes at F, - at its W or BW). With ``w_bytes`` (per stage, what a
    deferred W keeps: its linears' inputs, ``Item.w_act_bytes``) a split B frees the stage's bytes but
    keeps ``w_bytes`` until its W, as the runtime does (B frees the graph; the queued weight GEMMs hold
    their inputs, recomputed ones included).

    ``input_bytes`` (per stage, part of ``stage_bytes``: the hidden states a stage receives, which its
    first norm or recomputed region saves): the runtime's stage keeps its micro-batch's inputs until
    its W (or BW), so B does not free them; and at the turn of a V, where the previous stage on this
    rank hands its output over without a send, that stage keeps the same storage as its output until
    its own W: the bytes go when both are done (``runtime/stage.py``: ``_drop`` at W)."""
    return _ActivationWalk(ops, stage_bytes, w_bytes, input_bytes).peak


class _ActivationWalk:
    """``activation_peak_bytes``'s walk: live bytes op by op, stage inputs released when every holder is done."""

    def __init__(self, ops: list, stage_bytes: list[float], w_bytes: list[float] | None,
                 input_bytes: list[float] | None) -> None:
        self.stage_bytes, self.w_bytes = stage_bytes, w_bytes
        self.input_bytes = input_bytes if input_bytes is not None else [0.0] * len(stage_bytes)
        self.holders: dict[tuple[int, int, int], set[tuple[int, int, int]]] = {}
        self.live = self.peak = 0.0
        local = {(op.chain, op.stage) for item in ops for op in parts(item)}
        for item in ops:
            for op in parts(item):
                self.step(op, local)

    def add(self, n: float) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def step(self, op, local: set[tuple[int, int]]) -> None:
        s, key = op.stage, (op.chain, op.stage, op.mb)
        r = rule(op.kind)
        self.add(r.holds * self.stage_bytes[s])
        if r.holds and self.input_bytes[s]:
            # its input's storage: held by this stage, and by the previous one when handed over locally
            handed = {(c, t, m) for _, c, t, m in needs(op, len(self.stage_bytes)) if (c, t) in local}
            self.holders[key] = {key} | handed
        kept = self.input_bytes[s]
        if self.w_bytes is not None and op.kind == OpKind.B:
            self.add(self.w_bytes[s] - self.stage_bytes[s] + kept)
            return
        if self.w_bytes is not None and op.kind == OpKind.W:
            self.live -= self.w_bytes[s]
        elif r.frees:
            self.live -= r.frees * (self.stage_bytes[s] - kept)
        else:
            return
        self._release(key)

    def _release(self, done: tuple[int, int, int]) -> None:
        """``done``'s W (or BW) ran: drop it as a holder of its own input and of the next stage's."""
        for key in [k for k, held in self.holders.items() if done in held]:
            held = self.holders[key]
            held.discard(done)
            if not held:
                del self.holders[key]
                self.live -= self.input_bytes[key[1]]


def memory_breakdown(strategy: Strategy, stages: list[list[Item]], local: list[int], act_bytes: float,
                     extra_params: float = 0.0) -> dict[str, float]:
    """Weights (with FP8 training, each ``FP8Linear``'s cached E4M3 copy of its weight too: 1 byte per
    converted parameter, the block scales aside), gradients, optimizer state and activations, in GB:
    the sums of ``memory_terms.memory_terms`` (each term's formula and the code that keeps it).

    The optimizer state is divided over the data-parallel group (experts': the expert-data-parallel
    group) when the strategy's mode shards it (zero1, fsdp); weights and gradients are whole in every
    mode, since that is what the step's peak holds (FSDP unshards its stages for the whole step)."""
    return totals(memory_terms(strategy, stages, local, act_bytes, extra_params))


# ----- one strategy ------------------------------------------------------------------------------
AUTO_TIME_BUDGET = 5.0  # seconds per auto search inside the planner
SCHEDULE_CACHE_SIZE = 256  # hand schedules kept between estimates (a plan tries a few dozen sizes)


@lru_cache(maxsize=SCHEDULE_CACHE_SIZE)
def hand_schedule(name: str, num_ranks: int, num_microbatches: int, options: tuple[tuple[str, object], ...] = ()
                  ) -> Schedule:
    """A hand schedule, built once per (name, P, M, options) and shared by every estimate that needs it.

    Bounded: a long-lived process planning many models keeps at most ``SCHEDULE_CACHE_SIZE``.
    Callers must not modify the schedule they get.
    """
    return build_schedule(name, num_ranks, num_microbatches, **dict(options))


def _schedule(strategy: Strategy, costs: Costs) -> Schedule:
    options = schedule_options(strategy)
    if strategy.schedule == AUTO:  # searched for these costs: not cached
        return build_schedule(AUTO, strategy.pp, strategy.num_microbatches, costs=costs,
                              time_budget=AUTO_TIME_BUDGET, **options)
    return hand_schedule(strategy.schedule, strategy.pp, strategy.num_microbatches, tuple(sorted(options.items())))


def estimate(model: ModelSpec, system: SystemSpec, strategy: Strategy) -> Estimate:
    """Step time, bubble and the per-GPU memory breakdown of ``strategy`` (raises ScheduleError if invalid)."""
    if strategy.dp % strategy.ep:
        raise ScheduleError(f"expert parallel size {strategy.ep} must divide the data parallel size {strategy.dp}")
    if model.is_moe and model.expert_num % strategy.ep:
        raise ScheduleError(f"expert parallel size {strategy.ep} must divide the {model.expert_num} experts")
    tokens = strategy.seq_len * strategy.micro_batch_size
    family = family_of(model)  # what the memory terms name as the code that keeps them
    stages = stage_items(model, strategy, system)
    costs = stage_costs(model, strategy, system, stages)
    sched = _schedule(strategy, costs)
    res, timing = _simulate(strategy, system, stages, sched, costs)
    worst = None
    per_rank, rank_memory = [], []
    optimizer = 0.0
    # sequence parallelism shards every saved activation over the tensor-parallel group (Korthikanti et al.)
    shard = tokens / strategy.tp
    stage_bytes = [sum(i.act_bytes for i in g) * shard for g in stages]
    w_bytes = [sum(i.w_act_bytes for i in g) * shard for g in stages]
    hidden = model.hidden_size * (4.0 if strategy.dtype == "fp32" else 2.0) * shard  # a stage's received input
    in_bytes = [0.0] + [hidden] * (len(stages) - 1)
    # the norm saves a float32 copy, not the input: the stage holds it besides (the "norm" saver keeps the
    # input itself as the norm's saved tensor, already counted in act_bytes)
    if strategy.dtype != "fp32" and "norm" not in active_savers():
        stage_bytes = [b + i for b, i in zip(stage_bytes, in_bytes)]
    executed = executed_schedule(sched)  # the order the runtime runs: adjacent B and W fused (schedules/fuse.py)
    for r in range(strategy.pp):
        local = sorted({s for _, s in sched.local_stages(r)})
        # MTP needs the embedding: a last stage away from the first keeps its own copy
        extra = model.vocab_size * model.hidden_size if model.mtp_depth and len(stages) - 1 in local \
            and 0 not in local else 0.0
        acts = activation_peak_bytes(executed.ranks[r], stage_bytes, w_bytes, in_bytes)
        terms = memory_terms(strategy, stages, local, acts, extra, stage_bytes,
                             experts_code=family.experts_code if model.is_moe else None, saved_code=family.saved_code)
        mem = totals(terms)
        optimizer = max(optimizer, optimizer_step_time(strategy, system, stages, local))
        per_rank.append(mem["total"])
        rank_memory.append(mem)
        if worst is None or mem["total"] > worst[0]["total"]:
            worst = (mem, res.peak_activations[r], r, terms)
    mem, peak, fullest, fullest_terms = worst
    step = timing.step + optimizer
    useful = model.flops_per_token(strategy.seq_len) * tokens * strategy.num_microbatches * strategy.dp
    mfu = useful / (strategy.gpus * system.tflops(strategy.dtype) * 1e12 * step)
    fits = mem["total"] <= system.gpu_memory_gb * system.mem_factor
    return Estimate(strategy, step, timing.pipeline, timing.step - timing.pipeline, timing.bubble_rate, mem, peak,
                    [len(g) for g in stages], mfu, fits, per_rank_gb=per_rank, costs=timing.costs,
                    dp_sync_total=timing.total, tied_across_stages=ties_across_stages(model, len(stages)),
                    optimizer_time=optimizer, memory_rank=fullest, memory_terms=fullest_terms, rank_memory=rank_memory,
                    blocks_per_stage=[sum(1 for i in g if i.name.startswith("layer")) for g in stages])


@dataclass(frozen=True)
class _Timing:
    step: float
    pipeline: float      # the compute's makespan
    bubble_rate: float   # idle share of the compute's makespan (the pipeline bubble)
    total: float         # the data-parallel sync with nothing hidden
    costs: Costs


def _simulate(strategy: Strategy, system: SystemSpec, stages: list[list[Item]], sched: Schedule, costs: Costs
              ) -> tuple[SimResult, _Timing]:
    """Simulate the schedule with each stage's gradient reduction after its last W/BW, priced by the
    network model; with nothing to reduce (one replica, one copy of each stage) the plain schedule."""
    sync = stage_sync_times(strategy, system, stages, sched)
    gather = param_gather_time(strategy, system, stages, sched)
    if not any(sync) and not gather:
        res = run_schedule(sched, costs, record=False)
        return res, _Timing(res.makespan, res.makespan, res.bubble_rate, 0.0, costs)
    priced = replace(costs, dp_sync=sync)
    res = run_schedule(_reduced(strategy, sched), priced, record=False)
    ends = [end - exposed for end, exposed in zip(res.rank_end, res.dp_exposed)]  # each rank's compute end
    pipeline = max(ends)
    idle = sum(pipeline - b for b in res.busy)
    total = max(sum(sync[s] for _, s in sched.local_stages(r)) for r in range(sched.num_ranks)) + gather
    return res, _Timing(res.makespan + gather, pipeline, idle / (len(ends) * pipeline) if pipeline else 0.0, total,
                        priced)


def _reduced(strategy: Strategy, sched: Schedule) -> Schedule:
    """``sched`` with its gradient reductions; built once per hand schedule (shared, never modified)."""
    if strategy.schedule == AUTO:
        return add_grad_reduction(sched)
    return reduced_hand_schedule(strategy.schedule, strategy.pp, strategy.num_microbatches,
                         tuple(sorted(schedule_options(strategy).items())))


@lru_cache(maxsize=SCHEDULE_CACHE_SIZE)
def reduced_hand_schedule(name: str, num_ranks: int, num_microbatches: int,
                          options: tuple[tuple[str, object], ...] = ()) -> Schedule:
    """``hand_schedule`` with its gradient reductions (``add_grad_reduction``), built once per key."""
    return add_grad_reduction(hand_schedule(name, num_ranks, num_microbatches, options))
