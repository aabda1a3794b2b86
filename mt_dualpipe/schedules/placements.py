"""The placements every schedule family runs on, built in one place.

A placement says which rank runs each stage: ``placement[chain][stage] -> rank``; with it comes
``microbatch_chain[m]``, the chain micro-batch ``m`` flows through. Generators, ``auto``, the
planner and model families (which modules a rank builds) all take their layout from here.

* ``linear``: one chain of P stages, stage s on rank s (GPipe, 1F1B, ZB-H1/H2);
* ``v``: one chain of 2P stages in a V — down ranks 0..P-1, back up P-1..0 (ZB-V, DualPipeV);
* ``dual``: two mirrored chains of P stages, 0..P-1 and P-1..0; the first half of the
  micro-batches (rounded up) enters at rank 0, the rest at rank P-1 (DualPipe);
* ``interleaved``: one chain of v*P stages, stage s on rank s mod P (Megatron's virtual pipeline).

``balanced_cuts`` places a model's layers on a chain's stages: contiguous parts with the smallest
heaviest part (``split_model`` and the planner both use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ScheduleError

PLACEMENTS = ("linear", "v", "dual", "interleaved")
"""Placement names ``make_placement`` accepts."""


@dataclass(frozen=True)
class Placement:
    """A placement and the chain of every micro-batch: what a ``Schedule`` is laid out on."""

    name: str
    num_ranks: int
    ranks: tuple[tuple[int, ...], ...]      # ranks[chain][stage] -> rank
    microbatch_chain: tuple[int, ...]

    @property
    def num_chains(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        """Stages per chain."""
        return len(self.ranks[0])

    def local_stages(self, rank: int) -> list[tuple[int, int]]:
        """The (chain, stage) pairs ``rank`` runs, in (chain, stage) order."""
        return [(c, s) for c, chain in enumerate(self.ranks) for s, r in enumerate(chain) if r == rank]


def linear(num_ranks: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(num_ranks)),)


def v_shape(num_ranks: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(num_ranks)) + tuple(reversed(range(num_ranks))),)


def dual(num_ranks: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(range(num_ranks)), tuple(reversed(range(num_ranks))))


def interleaved(num_ranks: int, virtual_stages: int) -> tuple[tuple[int, ...], ...]:
    return (tuple(s % num_ranks for s in range(virtual_stages * num_ranks)),)


def dual_chains(num_microbatches: int) -> tuple[int, ...]:
    """DualPipe's micro-batch split: the first half (rounded up) on chain 0, the rest on chain 1."""
    half = (num_microbatches + 1) // 2
    return (0,) * half + (1,) * (num_microbatches - half)


def make_placement(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Placement:
    """The named placement for P ranks and M micro-batches; ``ScheduleError`` for an unknown name."""
    P, M = num_ranks, num_microbatches
    if name == "linear":
        return Placement(name, P, linear(P), (0,) * M)
    if name == "v":
        return Placement(name, P, v_shape(P), (0,) * M)
    if name == "dual":
        if M < 2:
            raise ScheduleError(f"placement 'dual' needs at least 2 micro-batches (one per direction), got {M}")
        return Placement(name, P, dual(P), dual_chains(M))
    if name == "interleaved":
        return Placement(name, P, interleaved(P, virtual_stages), (0,) * M)
    raise ScheduleError(f"unknown placement {name!r}; allowed: {', '.join(PLACEMENTS)}")


def balanced_cuts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Boundaries ``[0, c1, ..., len(costs)]`` of ``num_stages`` non-empty contiguous parts with the
    smallest possible maximum part cost (ties: the earliest cut), by dynamic programming."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max cost of splitting the first i layers into k parts; cut[k][i]: its last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]
