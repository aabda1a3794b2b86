"""Interleaved 1F1B (Megatron-LM's virtual pipeline): v model chunks per rank, round-robin.

One chain of v*P stages; stage s runs on rank s mod P, so rank r holds chunks j = 0..v-1, the
stages j*P + r. Micro-batches move in groups of P: a rank runs chunk 0's forward for P
micro-batches, then chunk 1's for the same P, ... then the next group. Backwards visit the
chunks in reverse. Counting both as one stream of v*M "virtual" steps per rank, the k-th step is

    chunk = (k // P) % v   (reversed, v-1-chunk, for backwards),   micro-batch = (k // (v*P)) * P + k % P

Rank r warms up with 2(P-1-r) + (v-1)P forwards (all of them when M == P, as Megatron does),
then alternates F and BW, then drains. The bubble shrinks to (P-1)(F+B+W) of a chunk, i.e. v
times less than 1F1B's for the same model, for v times more point-to-point messages. Megatron
only defines this order for M a multiple of P, and so does this module.
"""

from __future__ import annotations

from . import ops as K
from . import placements
from .errors import ScheduleError
from .info import ScheduleInfo
from .ir import Op, Schedule


def _virtual_step(k: int, P: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward (or backward) step."""
    chunk = (k // P) % v
    if not forward:
        chunk = v - 1 - chunk
    return chunk, (k // (v * P)) * P + k % P


def interleaved_order(rank: int, P: int, M: int, v: int) -> list[Op]:
    total = v * M
    warmup = total if M == P else min(2 * (P - 1 - rank) + (v - 1) * P, total)

    def op(kind: str, k: int) -> Op:
        chunk, mb = _virtual_step(k, P, v, kind == K.F)
        return Op(kind, 0, chunk * P + rank, mb)

    ops = [op(K.F, k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [op(K.F, warmup + k), op(K.BW, k)]
    ops += [op(K.BW, k) for k in range(total - warmup, total)]
    return ops


def build_interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    P, M, v = num_ranks, num_microbatches, virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise ScheduleError(f"virtual_stages must be an integer >= 2, got {v!r}")
    if M % P:
        raise ScheduleError(f"interleaved-1f1b needs num_microbatches divisible by num_ranks ({P}), got {M}")
    placement = placements.interleaved(P, v)
    ranks = [interleaved_order(r, P, M, v) for r in range(P)]
    return Schedule("interleaved-1f1b", P, M, placement, [0] * M, ranks, meta={"virtual_stages": v})


SCHEDULES = (
    ScheduleInfo("interleaved-1f1b", "Megatron's interleaved 1F1B: v chunks per rank round-robin, bubble / v",
                 "virtual_stages (v) >= 2; M a multiple of P", placement="interleaved",
                 build=build_interleaved_1f1b),
)
"""This module's schedules, for ``builtin.BUILTIN`` (the registry's list of built-ins)."""
