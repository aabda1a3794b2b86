"""One pipeline rank's memory, term by term: each term's bytes, the formula that gives them and the code
that keeps them, so a reported total can be checked against the runtime piece by piece.

``estimate.memory_breakdown`` sums these terms into the four columns of the plan table (weights,
gradients, optimizer, activations); ``mt-dualpipe plan`` prints them for the published (or the best)
configuration. Parameters are counted per rank from its stages' items (``ModelSpec.items``); a weight
two local stages share is one item (DeepSeek-V3's MTP reads the main embedding:
``models/deepseek_v3/stages.py``, ``share_local_embedding``), so it is counted once, and only a
last stage away from the first keeps a copy of the embedding (``extra_params``).

Bytes per parameter are DeepSeek-V3's recipe (``weight_bytes``: BF16 weights, FP32 gradients, an FP32
master and, with FP8, BF16 Adam moments). The runtime's optimizers step the parameters in their own
dtype, with gradients in that dtype too, so a run with BF16 parameters keeps less than these terms for
gradients and optimizer state, never more; the terms say so where it applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..parallel.modes import mode_for_zero_stage
from .model import Item
from .strategy import Strategy

GB = 1e9
PARTS = ("weights", "gradients", "optimizer", "activations")
"""The plan table's memory columns, in order."""


@dataclass(frozen=True)
class MemoryTerm:
    """Bytes of one kind of tensor on one rank, in GB, with how they are counted and who keeps them."""

    part: str      # one of PARTS
    name: str
    gb: float
    formula: str   # the count, with this rank's numbers
    kept_by: str   # the code that holds these tensors in a run

    def line(self) -> str:
        return f"{self.part:<11} {self.gb:6.2f} GB  {self.name}: {self.formula}  [{self.kept_by}]"


def weight_bytes(strategy: Strategy) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter: BF16 weights, FP32 gradients,
    FP32 master + two Adam moments (BF16 moments for FP8 training, as DeepSeek-V3; FP32 otherwise);
    plain FP32 training keeps FP32 weights, gradients and two moments (no master copy)."""
    if strategy.dtype == "fp32":
        return 4.0, 4.0, 8.0
    return 2.0, 4.0, (8.0 if strategy.dtype == "fp8" else 12.0)


@dataclass(frozen=True)
class RankParams:
    """The parameters one rank holds, split as memory treats them (per rank: tp and ep divided out)."""

    dense: float    # non-expert parameters (dense layers, attention, shared experts, embedding, head, norms)
    expert: float   # this rank's routed experts
    fp8: float      # of both, those in linears FP8 training converts (each keeps a 1-byte copy)

    @classmethod
    def of(cls, strategy: Strategy, stages: Sequence[Sequence[Item]], local: Sequence[int],
           extra_params: float = 0.0) -> RankParams:
        tp = strategy.tp  # dense weights (and the vocabulary) are split over tensor parallel, experts over ep
        dense = (sum(i.params for s in local for i in stages[s]) + extra_params) / tp
        expert = sum(i.expert_params for s in local for i in stages[s]) / strategy.ep
        fp8 = 0.0
        if strategy.dtype == "fp8":  # the experts' and the layers' linears (not the embedding, head or router)
            fp8 = sum(i.linear_params for s in local for i in stages[s]) / tp + expert
        return cls(dense, expert, fp8)


def memory_terms(strategy: Strategy, stages: Sequence[Sequence[Item]], local: Sequence[int], act_bytes: float,
                 extra_params: float = 0.0, stage_bytes: Sequence[float] | None = None) -> list[MemoryTerm]:
    """The terms of one rank holding ``local`` stages with ``act_bytes`` of saved activations at its peak
    (``stage_bytes``: what one micro-batch of each stage saves, named in the activations' formula).

    The optimizer state is divided over the data-parallel group (experts': the expert-data-parallel
    group, dp / ep) when the strategy's mode shards it (zero1, fsdp); weights and gradients are whole
    in every mode, since that is what the step's peak holds (FSDP unshards its stages for the whole step;
    zero1 reduce-scatters the gradients only after the rank's last W)."""
    wb, gb, ob = weight_bytes(strategy)
    p = RankParams.of(strategy, stages, local, extra_params)
    mode = mode_for_zero_stage(strategy.zero)
    edp = max(1, strategy.dp // strategy.ep)
    shard_dense, shard_expert = (strategy.dp, edp) if mode.shards_optimizer_state else (1, 1)
    b = f"{p.dense / 1e9:.3f} B"
    e = f"{p.expert / 1e9:.3f} B"
    stage_code = "the stage modules' parameters (stages_for_rank; a weight two local stages share counted once)"
    terms = [
        MemoryTerm("weights", "non-expert weights", p.dense * wb / GB, f"{b} params x {wb:g} B", stage_code),
        MemoryTerm("weights", "routed-expert weights", p.expert * wb / GB,
                   f"{e} params (experts / ep {strategy.ep}) x {wb:g} B",
                   "the rank's experts (layers/moe.py: MoEBlock over its ep group)"),
    ]
    if p.fp8:
        terms.append(MemoryTerm("weights", "FP8 weight copies", p.fp8 / GB, f"{p.fp8 / 1e9:.3f} B linear params x 1 B",
                                "FP8Linear's cached E4M3 weight (fp8/linear.py)"))
    per_mb = ""
    if stage_bytes is not None and local:
        held = act_bytes / max(stage_bytes[s] for s in local) if any(stage_bytes[s] for s in local) else 0.0
        per_mb = " (" + ", ".join(f"stage {s}: {stage_bytes[s] / GB:.3f} GB" for s in local) + \
            f" per micro-batch; the peak is {held:.2f} micro-batches of the largest)"
    terms += [
        MemoryTerm("gradients", "gradients", (p.dense + p.expert) * gb / GB,
                   f"({b} + {e}) params x {gb:g} B", "each parameter's .grad until the step's reduction "
                   "(parallel/grad_sync.py; zero1 keeps only its shard after the reduce-scatter); FP32 as the "
                   "report's recipe: the runtime's .grad has the parameter's dtype, so a BF16 model keeps less"),
        MemoryTerm("optimizer", "non-expert optimizer state", p.dense * ob / shard_dense / GB,
                   f"{b} params x {ob:g} B / {shard_dense}", _optimizer_code(strategy, mode.name)),
        MemoryTerm("optimizer", "routed-expert optimizer state", p.expert * ob / shard_expert / GB,
                   f"{e} params x {ob:g} B / {shard_expert} (dp / ep)", _optimizer_code(strategy, mode.name)),
        MemoryTerm("activations", "saved activations at the rank's peak", act_bytes / GB,
                   "the most bytes the rank's op order holds at once: per stage, tokens x the bytes its "
                   "layers save per token (planner/activations.py), held from F to B/BW" + per_mb,
                   "the autograd graphs of the micro-batches in flight (runtime/stage.py; recorded by "
                   "runtime/activation_bytes.py)"),
    ]
    return terms


def _optimizer_code(strategy: Strategy, mode: str) -> str:
    """Who keeps the optimizer state. The FP32 master is the report's recipe (§3.3.1) and counted as such; the
    runtime's optimizers step the parameters in their own dtype (no separate master: a BF16 model keeps less)."""
    if strategy.dtype == "fp32":
        state = "two FP32 moments (the parameters are the master)"
    elif strategy.dtype == "fp8":
        state = "FP32 master (the report's; the runtime steps parameters in their dtype) + two BF16 moments " \
                "(optim/adamw.py AdamWBF16)"
    else:
        state = "FP32 master (the report's; the runtime steps parameters in their dtype) + two FP32 moments"
    return f"{state}, sharded by {mode} (parallel/zero.py)" if mode != "allreduce" else state


def totals(terms: Sequence[MemoryTerm]) -> dict[str, float]:
    """The plan table's columns: each part's sum, and the total."""
    out = {part: sum(t.gb for t in terms if t.part == part) for part in PARTS}
    out["total"] = sum(out.values())
    return out
