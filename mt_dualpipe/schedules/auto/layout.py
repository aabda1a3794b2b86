"""The per-rank view of a placement that every part of the ``auto`` search reads.

The placement itself comes from ``schedules.placements`` (the one place placements are built);
``Layout`` only precomputes what the search asks again and again: the micro-batches of each
chain, the (chain, stage) pairs of each rank, and how many activation slots one micro-batch of a
chain needs on each rank (what the memory reservation and the smallest allowed limit follow from).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from ..placements import Placement, make_placement

PLACEMENTS = ("linear", "v", "dual")
"""The placements ``auto`` searches (the hand schedules it competes with exist for these)."""


class Layout:
    """A ``Placement`` with the per-rank tables of the search, computed once per search."""

    def __init__(self, placement: Placement) -> None:
        self.name = placement.name
        self.placement = placement.ranks
        self.microbatch_chain = placement.microbatch_chain
        self.P = P = placement.num_ranks
        self.C = placement.num_chains
        self.S = placement.num_stages
        self.M = len(placement.microbatch_chain)
        self.chain_mbs = [[m for m, c in enumerate(self.microbatch_chain) if c == k] for k in range(self.C)]
        self.local = [placement.local_stages(r) for r in range(P)]
        # stages of chain c on rank r: the activation slots one micro-batch of c needs there
        self.count = [[sum(1 for x in chain if x == r) for r in range(P)] for chain in self.placement]
        self.chain_ranks = [sorted(set(chain)) for chain in self.placement]
        self.min_limit = max(max(row) for row in self.count)

    @classmethod
    def named(cls, name: str, num_ranks: int, num_microbatches: int) -> Layout:
        """The layout of placement ``name`` (linear, v or dual) for P ranks and M micro-batches."""
        if name not in PLACEMENTS:
            raise ScheduleError(f"unknown placement {name!r}; allowed: {', '.join(PLACEMENTS)}")
        return cls(make_placement(name, num_ranks, num_microbatches))


def memory_limits(memory_limit: int | Sequence[int], P: int) -> list[int]:
    """One activation limit per rank from an int or a list of P ints; ``ScheduleError`` otherwise."""
    if isinstance(memory_limit, bool):
        raise ScheduleError(f"memory_limit must be a positive integer or a list of {P}, got {memory_limit!r}")
    if isinstance(memory_limit, int):
        limits = [memory_limit] * P
    else:
        try:
            limits = [int(x) for x in memory_limit]
        except (TypeError, ValueError) as exc:
            raise ScheduleError(f"memory_limit must be a positive integer or a list of {P}, "
                                f"got {memory_limit!r}") from exc
        if len(limits) != P:
            raise ScheduleError(f"memory_limit has {len(limits)} values, expected one per rank ({P})")
    if any(x < 1 for x in limits):
        raise ScheduleError(f"memory_limit must be at least 1 activation per rank, got {memory_limit!r}")
    return limits
