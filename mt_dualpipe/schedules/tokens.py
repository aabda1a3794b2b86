"""What a micro-batch costs, from the lengths of the sequences in it.

A transformer stage's work on a sequence of ``n`` tokens has a part linear in ``n`` (every GEMM:
projections, MLP, head) and attention, which scores each query against every earlier key:
``n (n + 1) / 2`` pairs under a causal mask, so quadratic in the sequence's length. Sequences
packed into one micro-batch attend only within themselves (block-diagonal "varlen" attention),
so a micro-batch's attention is the sum over its sequences, not the square of its total length.
A padded micro-batch computes its padding: give each of its sequences the padded length.

Per stage and micro-batch ``TokenCost`` counts

* F = linear + attention (the forward),
* B = linear + ``backward_attention`` x attention (the input gradient: the GEMMs' input-gradient
  half and attention's backward, about twice its forward),
* W = linear (the GEMMs' weight-gradient half; attention has no weights),

and ``microbatch_costs`` turns a step's micro-batches into ``Costs``: the per-stage times of their
mean, and per micro-batch the factors the simulator and ``auto`` read (``Costs.mb_scale`` for F
and B: the micro-batch's F + B over the mean's, so the two together are exact and each on its own
split in the mean's proportion; ``Costs.mb_scale_w`` for W).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .costs import Costs
from .errors import ScheduleError


@dataclass(frozen=True)
class TokenCost:
    """Seconds of one stage's work per token (``per_token``, the GEMMs of a forward) and per causal
    attention pair (``per_pair``, a forward's attention); see the module docstring."""

    per_token: float
    per_pair: float
    backward_attention: float = 2.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_pair", "backward_attention"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ScheduleError(f"TokenCost.{name} must be a non-negative number, got {value!r}")

    def parts(self, lengths: Sequence[int]) -> tuple[float, float]:
        """(linear, attention) forward time of a micro-batch holding sequences of ``lengths`` tokens."""
        bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 0]
        if bad:
            raise ScheduleError(f"sequence lengths must be non-negative integers, got {bad[0]!r}")
        return self.per_token * sum(lengths), self.per_pair * sum(n * (n + 1) // 2 for n in lengths)

    def times(self, lengths: Sequence[int]) -> tuple[float, float, float]:
        """(F, B, W) of one stage on a micro-batch holding sequences of ``lengths`` tokens."""
        linear, attention = self.parts(lengths)
        return linear + attention, linear + self.backward_attention * attention, linear


def microbatch_costs(micro_batches: Sequence[Sequence[int]], cost: TokenCost, **per_stage: Any) -> Costs:
    """``Costs`` of a step's micro-batches (each a list of sequence lengths, in arrival order): F, B and W
    of their mean, ``mb_scale`` / ``mb_scale_w`` per micro-batch, and ``per_stage`` (``comm``,
    ``a2a_f``, ...) as given. ``ScheduleError`` for an empty step or a step that computes nothing."""
    if not micro_batches:
        raise ScheduleError("microbatch_costs needs at least one micro-batch")
    times = [cost.times(lengths) for lengths in micro_batches]
    n = len(times)
    f, b, w = (sum(t[i] for t in times) / n for i in range(3))
    if f + b <= 0:
        raise ScheduleError("the micro-batches hold no tokens: nothing to schedule")
    scale = [(tf + tb) / (f + b) for tf, tb, _ in times]
    scale_w = [tw / w if w > 0 else 1.0 for _, _, tw in times]
    return Costs(f=f, b=b, w=w, mb_scale=scale, mb_scale_w=scale_w, **per_stage)
