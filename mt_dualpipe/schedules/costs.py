"""Per-op time costs that drive the simulator.

Each field is a number (the same for every stage) or a list indexed by the stage's position in
its chain. ``fb`` is the time of an overlapped F&B unit that pairs an F with a full backward
(BW); pairing an F with a plain B costs ``fb - w``. When ``fb`` is not given an FB unit costs
F + (B or BW): the overlap hides communication, not compute. ``a2a_f``/``a2a_b`` are the
exposed expert-parallel all-to-all of a lone F / B (or BW); inside an FB unit they are hidden.
``comm`` is the point-to-point latency of one hop between different ranks (indexed by the
sending stage when a list). ``dp_sync`` is the time of one stage's data-parallel gradient
reduction (a ``REDUCE_GRAD`` op): it runs on the communication stream, so only the part that
outlasts the rank's remaining compute is exposed. ``recompute`` is the forward work a stage
recomputes in its backward (activation recomputation): it is added to every B and BW of the
stage, once — W reuses what B recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from . import ops as K
from .errors import ScheduleError

COST_FIELDS = ("f", "b", "w", "fb", "comm", "a2a_f", "a2a_b", "dp_sync", "recompute")
Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


@dataclass(frozen=True)
class Costs:
    f: PerStage = 1.0
    b: PerStage = 1.0
    w: PerStage = 1.0
    fb: PerStage | None = None
    comm: PerStage = 0.0
    a2a_f: PerStage = 0.0
    a2a_b: PerStage = 0.0
    dp_sync: PerStage = 0.0
    recompute: PerStage = 0.0

    @classmethod
    def uniform(cls, f: float = 1.0, b: float = 1.0, w: float = 1.0, **kw: PerStage) -> Costs:
        return cls(f=f, b=b, w=w, **kw)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse the CLI form ``f,b,w[,fb[,comm]]`` (numbers separated by commas)."""
        try:
            values = [float(x) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise ScheduleError(f"--costs must be numbers 'f,b,w[,fb[,comm]]', got {text!r}") from exc
        if not 3 <= len(values) <= 5:
            raise ScheduleError(f"--costs takes 3 to 5 numbers 'f,b,w[,fb[,comm]]', got {len(values)} in {text!r}")
        fb = values[3] if len(values) > 3 else None
        comm = values[4] if len(values) > 4 else 0.0
        return cls(values[0], values[1], values[2], fb=fb, comm=comm)

    def scaled(self, factor: float) -> Costs:
        """Every time multiplied by ``factor`` (e.g. 1/v for the v-times smaller stages of a V schedule)."""
        def mul(v: PerStage | None) -> PerStage | None:
            if v is None:
                return None
            if isinstance(v, (int, float)):
                return v * factor
            return [x * factor for x in v]

        return Costs(**{k: mul(getattr(self, k)) for k in COST_FIELDS})

    def per_stage(self, num_stages: int) -> StageCosts:
        """Expand every field to a list of ``num_stages`` floats, checking lengths and signs."""
        def expand(name: str, value: PerStage | None) -> list[float] | None:
            if value is None:
                return None
            if isinstance(value, (int, float)):
                vals = [float(value)] * num_stages
            else:
                vals = [float(v) for v in value]
                if len(vals) != num_stages:
                    raise ScheduleError(
                        f"costs.{name} has {len(vals)} per-stage values but the chain has {num_stages} stages; "
                        "give one number or one value per stage"
                    )
            if any(v < 0 or v != v for v in vals):
                raise ScheduleError(f"costs.{name} must be non-negative numbers, got {value!r}")
            return vals

        f, b, w = expand("f", self.f), expand("b", self.b), expand("w", self.w)
        return StageCosts(
            f=f, b=b, w=w, fb=expand("fb", self.fb), comm=expand("comm", self.comm),
            a2a_f=expand("a2a_f", self.a2a_f), a2a_b=expand("a2a_b", self.a2a_b),
            dp_sync=expand("dp_sync", self.dp_sync), recompute=expand("recompute", self.recompute),
        )

    def describe(self) -> str:
        def fmt(v: PerStage | None) -> str:
            if v is None:
                return "-"
            if isinstance(v, (int, float)):
                return f"{v:g}"
            return "[" + ",".join(f"{x:g}" for x in v) + "]"

        text = f"F={fmt(self.f)} B={fmt(self.b)} W={fmt(self.w)}"
        if self.fb is not None:
            text += f" FB={fmt(self.fb)}"
        for name in ("comm", "a2a_f", "a2a_b", "dp_sync", "recompute"):
            value = getattr(self, name)
            if value != 0.0:
                text += f" {name}={fmt(value)}"
        return text


@dataclass(frozen=True)
class StageCosts:
    """``Costs`` expanded to per-stage lists (what the simulator's inner loop reads)."""

    f: list[float]
    b: list[float]
    w: list[float]
    fb: list[float] | None
    comm: list[float]
    a2a_f: list[float]
    a2a_b: list[float]
    dp_sync: list[float]
    recompute: list[float]

    def fb_cost(self, f_stage: int, b_kind: str, b_stage: int) -> float:
        """Cost of an overlapped F&B unit: all-to-all hidden, ``fb`` if given.

        A lone op's cost is its kind's rule in ``ops.RULES`` (``ops.op_cost``)."""
        rc = self.recompute[b_stage]
        if self.fb is not None:
            full = self.fb[f_stage]
            return rc + (full if b_kind == K.BW else max(0.0, full - self.w[b_stage]))
        back = self.b[b_stage] + (self.w[b_stage] if b_kind == K.BW else 0.0)
        return self.f[f_stage] + back + rc
