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

``mb_scale`` makes micro-batches uneven: one factor per micro-batch of the step (in arrival order,
the order the data loader hands them out), by which every forward and backward time of that
micro-batch is multiplied (F, B, the B part of BW, their all-to-all and recompute); ``mb_scale_w``
does the same for the weight-gradient part (W, the W part of BW; default: ``mb_scale``). A W is
GEMMs only, linear in tokens, while F and B also hold attention, quadratic in each sequence's
length (``tokens.TokenCost`` turns sequence lengths into both). Latency (``comm``) and
``dp_sync`` are not scaled. A schedule's ``microbatch_order`` says which of these micro-batches
each of its micro-batch slots runs; the simulator reads the factors through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Union

from . import ops as K
from .errors import ScheduleError

COST_FIELDS = ("f", "b", "w", "fb", "comm", "a2a_f", "a2a_b", "dp_sync", "recompute")
"""The per-stage time fields (what ``scaled`` multiplies); the per-micro-batch factors are ``MB_FIELDS``."""
MB_FIELDS = ("mb_scale", "mb_scale_w")
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
    mb_scale: Sequence[Number] | None = None
    mb_scale_w: Sequence[Number] | None = None

    def __post_init__(self) -> None:
        for name in MB_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _factors(name, value))
        if self.mb_scale_w is not None and (self.mb_scale is None or len(self.mb_scale_w) != len(self.mb_scale)):
            raise ScheduleError("costs.mb_scale_w needs costs.mb_scale with the same number of micro-batches "
                                f"({0 if self.mb_scale is None else len(self.mb_scale)}), got {len(self.mb_scale_w)}")

    @property
    def uneven(self) -> bool:
        """True when micro-batches differ in cost (``mb_scale`` given and not all ones)."""
        return self.mb_scale is not None and (any(x != 1.0 for x in self.mb_scale)
                                              or any(x != 1.0 for x in self.mb_scale_w or ()))

    def with_microbatches(self, mb_scale: Sequence[Number] | None, mb_scale_w: Sequence[Number] | None = None) -> Costs:
        """These per-stage costs with other per-micro-batch factors (None: every micro-batch alike)."""
        return replace(self, mb_scale=mb_scale, mb_scale_w=mb_scale_w)

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

        return Costs(**{k: mul(getattr(self, k)) for k in COST_FIELDS}, mb_scale=self.mb_scale,
                     mb_scale_w=self.mb_scale_w)

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
            mb_scale=self.mb_scale, mb_scale_w=self.mb_scale_w,
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
        if self.mb_scale is not None:
            text += f" mb_scale={fmt(list(self.mb_scale))}"
        if self.mb_scale_w is not None:
            text += f" mb_scale_w={fmt(list(self.mb_scale_w))}"
        return text


def _factors(name: str, value: object) -> tuple[float, ...]:
    """Per-micro-batch factors as a tuple of floats; ``ScheduleError`` naming the field otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ScheduleError(f"costs.{name} must be a list with one factor per micro-batch, got {value!r}")
    try:
        out = tuple(float(x) for x in value)
    except (TypeError, ValueError) as exc:
        raise ScheduleError(f"costs.{name} must hold numbers, got {value!r}") from exc
    if not out:
        raise ScheduleError(f"costs.{name} is empty; give one factor per micro-batch or None")
    bad = [x for x in out if not (x >= 0.0 and x != float("inf"))]
    if bad:
        raise ScheduleError(f"costs.{name} must be finite non-negative numbers, got {bad[0]!r}")
    return out


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
    mb_scale: tuple[float, ...] | None = None  # per micro-batch, in arrival order (``Costs.mb_scale``)
    mb_scale_w: tuple[float, ...] | None = None

    def fb_cost(self, f_stage: int, b_kind: str, b_stage: int, f_scale: float = 1.0, b_scale: float = 1.0,
                w_scale: float = 1.0) -> float:
        """Cost of an overlapped F&B unit: all-to-all hidden, ``fb`` if given.

        With micro-batch factors (``f_scale`` of the F half's micro-batch, ``b_scale`` and ``w_scale``
        of the backward half's) each half's compute is scaled: unset ``fb``, the unit is the sum of its
        scaled halves; given, the unit's time is split over the halves in proportion to their compute
        (F; B and recompute; W of a BW) and each share scaled. All factors 1: the plain unit.
        A lone op's cost is its kind's rule in ``ops.RULES`` (``ops.op_cost``)."""
        rc = self.recompute[b_stage]
        if f_scale == b_scale == w_scale == 1.0:
            if self.fb is not None:
                full = self.fb[f_stage]
                return rc + (full if b_kind == K.BW else max(0.0, full - self.w[b_stage]))
            back = self.b[b_stage] + (self.w[b_stage] if b_kind == K.BW else 0.0)
            return self.f[f_stage] + back + rc
        uf, ub, uw = self.fb_shares(f_stage, b_kind, b_stage)
        return uf * f_scale + ub * b_scale + uw * w_scale

    def fb_shares(self, f_stage: int, b_kind: str, b_stage: int) -> tuple[float, float, float]:
        """The plain unit's time split into the F half's, the backward half's B (and recompute) and its W share."""
        unit = self.fb_cost(f_stage, b_kind, b_stage)
        lf, lb = self.f[f_stage], self.b[b_stage] + self.recompute[b_stage]
        lw = self.w[b_stage] if b_kind == K.BW else 0.0
        if self.fb is None:
            return lf, lb, lw
        total = lf + lb + lw
        if total <= 0.0:
            return unit / 2, unit / 2, 0.0
        return unit * lf / total, unit * lb / total, unit * lw / total

    def slot_scales(self, order: Sequence[int] | None, num_microbatches: int) -> tuple[list[float], list[float]] | None:
        """Per micro-batch slot of a schedule, the (F/B factor, W factor) of the micro-batch it runs
        (``order[slot]``; None: slot m runs micro-batch m); None when the costs have no factors."""
        if self.mb_scale is None:
            return None
        if len(self.mb_scale) != num_microbatches:
            raise ScheduleError(f"costs.mb_scale has {len(self.mb_scale)} factors but the schedule has "
                                f"{num_microbatches} micro-batches; give one per micro-batch")
        k, kw = self.mb_scale, self.mb_scale_w or self.mb_scale
        slots = range(num_microbatches) if order is None else order
        return [k[m] for m in slots], [kw[m] for m in slots]
