"""One parallel strategy, as the planner enumerates, estimates and launches it.

Its own module so that the estimate, the data-parallel pricing (``dp_sync``) and the runnable
check (``runnable``) all build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.errors import ScheduleError
from ..schedules.registry import schedule_info

AUTO = "auto"  # the searched schedule: built per strategy for its costs (its ``placement``), never cached


@dataclass(frozen=True)
class Strategy:
    pp: int
    schedule: str
    num_microbatches: int
    ep: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    seq_len: int = 4096
    zero: int = 1
    dtype: str = "bf16"            # "fp8": FP8 GEMMs, FP8 dispatch and FP8-cached activations (DeepSeek-V3);
    #                                "fp32": everything in FP32 (CPU runs)
    recompute: str = "selective"
    virtual_stages: int = 1        # chunks per rank for interleaved-1f1b
    layers_per_stage: tuple[int, ...] | None = None  # decoder layers per stage (default: balanced by compute)
    placement: str = ""            # for schedule "auto": linear, v or dual
    attention: str = "fused"       # core attention saving: "fused" (flash-style, production GPUs) or "eager"
    #                                (the models' einsum core, S x S probabilities saved)
    tp: int = 1                    # tensor-parallel size (Megatron-style with sequence parallelism); ``dp``
    #                                counts data-parallel replicas of one tensor-parallel group

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def schedule_label(self) -> str:
        if self.schedule == AUTO:
            return f"auto/{self.placement}"
        return self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")

    def describe(self) -> str:
        return (f"pp={self.pp} {self.schedule_label} M={self.num_microbatches} ep={self.ep} dp={self.dp} "
                f"mbs={self.micro_batch_size}" + (f" tp={self.tp}" if self.tp > 1 else ""))


def schedule_options(strategy: Strategy) -> dict:
    """The build options of ``strategy``'s schedule: what its registry entry takes of the strategy's."""
    info = schedule_info(strategy.schedule)
    wanted: dict[str, object] = {"virtual_stages": strategy.virtual_stages}
    if strategy.schedule == AUTO:
        if not strategy.placement:
            raise ScheduleError("schedule 'auto' needs a placement (Strategy.placement: linear, v or dual)")
        wanted["placement"] = strategy.placement
    return {k: v for k, v in wanted.items() if k in info.options}
