"""The data-parallel modes, defined once: what each reduces by, what it shards, what it runs with.

``DP_MODES`` is the one list. The runtime's ``dp_mode=`` check and its refusals (``runtime/
data_parallel.py``), the sync objects (``GradSync`` reads ``reduces_by`` and ``wire_dtype``), the
planner's "runnable" column and ``--zero`` choices, and the demo's ``--dp-mode`` all read it; a mode
is added here and in the one module that implements ``stage_sync.StageGradSync`` for it
(``docs/architecture.md``, "Adding a data-parallel mode"). Pure Python: the planner, which runs
without torch, reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelMode:
    """One data-parallel mode: how gradients are reduced, what is sharded, and what it can run with."""

    name: str
    summary: str
    zero_stage: int               # the planner's ZeRO stage: 0 replicate, 1 optimizer state, 3 parameters
    reduces_by: str               # the collective at REDUCE_GRAD
    shards_optimizer_state: bool
    shards_parameters: bool       # between steps (FSDP keeps a stage unsharded during the step)
    needs_fully_shard: bool       # stage modules must be wrapped with fully_shard
    expert_parallel: bool         # runs with ep > 1 (dense over dp x ep, experts over dp)
    tied_weights: bool            # reduces weights tied across stages
    tensor_parallel: bool         # reduces DTensor tensor-parallel shards
    wire_dtype: str | None = None  # gradients travel in this torch dtype (None: their own)

    @property
    def zero_optimizer(self) -> bool:
        """Whether the optimizer steps the gradient shards the sync holds (``ZeroOptimizer``): a
        reduce-scatter of plain parameters (with ``fully_shard`` the parameters are the shards)."""
        return self.reduces_by == "reduce_scatter" and not self.shards_parameters


DP_MODES: dict[str, DataParallelMode] = {m.name: m for m in (
    DataParallelMode("allreduce", "all-reduce every gradient; any optimizer steps the full .grad (DDP semantics)",
                     zero_stage=0, reduces_by="all_reduce", shards_optimizer_state=False, shards_parameters=False,
                     needs_fully_shard=False, expert_parallel=True, tied_weights=True, tensor_parallel=True),
    DataParallelMode("zero1", "reduce-scatter gradients; each rank steps its shard (ZeroOptimizer) and "
                     "all-gathers the parameters", zero_stage=1, reduces_by="reduce_scatter",
                     shards_optimizer_state=True, shards_parameters=False, needs_fully_shard=False,
                     expert_parallel=True, tied_weights=True, tensor_parallel=False),
    DataParallelMode("fsdp", "fully_shard stages kept unsharded for the step, gradients reduce-scattered after "
                     "the last W", zero_stage=3, reduces_by="reduce_scatter", shards_optimizer_state=True,
                     shards_parameters=True, needs_fully_shard=True, expert_parallel=False, tied_weights=False,
                     tensor_parallel=False),
    DataParallelMode("allreduce_bf16", "all-reduce every gradient sent as bfloat16 (half the bytes of float32; DDP's "
                     "bf16_compress_hook), written back in the gradient's dtype", zero_stage=0, reduces_by="all_reduce",
                     shards_optimizer_state=False, shards_parameters=False, needs_fully_shard=False,
                     expert_parallel=True, tied_weights=True, tensor_parallel=True, wire_dtype="bfloat16"),
)}
"""Every data-parallel mode the runtime runs, by name (the one list: runtime, planner and CLI read it)."""


def get_mode(name: str) -> DataParallelMode:
    """The mode called ``name``, or one error listing the modes there are."""
    try:
        return DP_MODES[name]
    except KeyError:
        raise ValueError(f"unknown data-parallel mode {name!r}; allowed: {', '.join(DP_MODES)}") from None


def mode_for_zero_stage(stage: int) -> DataParallelMode:
    """The mode that runs the planner's ZeRO ``stage`` (0, 1 or 3): the first such row of ``DP_MODES``."""
    for m in DP_MODES.values():
        if m.zero_stage == stage:
            return m
    stages = sorted({m.zero_stage for m in DP_MODES.values()})
    raise ValueError(f"no data-parallel mode runs ZeRO stage {stage}; allowed: {', '.join(map(str, stages))}")
