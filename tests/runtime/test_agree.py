"""``runtime/agree.py``: the step agreements as a star over the link (each rank's vector to pipeline rank 0, the
total back), checked on 3 gloo ranks: every rank gets the sum, agreements in a row on one tag stay in order, and
a rank that never posts makes the others' wait expire instead of hanging."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from mt_dualpipe.runtime.agree import END_TAG, START_TAG, StarSum
from tests.helpers.dist import run_ranks


def _sums(rank: int, world: int) -> list[list[int]]:
    pg = dist.group.WORLD
    timeout = datetime.timedelta(seconds=30)
    got = []
    for step in range(3):  # two agreements per "step", on their own tags, the second posted before the first waits
        start = torch.tensor([rank + 1, 10 * step + rank], dtype=torch.int64)
        end = torch.zeros(1, dtype=torch.int64) + step
        a, b = StarSum(pg, rank, world, START_TAG, start), StarSum(pg, rank, world, END_TAG, end)
        assert a.wait(timeout) and b.wait(timeout)
        got.append(start.tolist() + end.tolist())
    return got


def test_every_rank_gets_the_sum_in_order():
    per_rank = run_ranks(_sums, 3)
    want = [[1 + 2 + 3, 30 * step + 0 + 1 + 2, 3 * step] for step in range(3)]
    assert per_rank == [want] * 3


def _rank_two_never_posts(rank: int, world: int) -> str:
    pg = dist.new_group(backend="gloo")  # a group of its own: the expired wait closes it, not the test's group
    if rank == 2:
        return "absent"
    try:
        StarSum(pg, rank, world, START_TAG, torch.ones(1, dtype=torch.int64)).wait(datetime.timedelta(seconds=1))
    except RuntimeError as exc:  # gloo's timeout; rank 1 then sees the link rank 0 closed
        return type(exc).__name__
    return "returned"


def test_a_missing_rank_makes_the_wait_expire():
    assert run_ranks(_rank_two_never_posts, 3, timeout=60) == ["RuntimeError", "RuntimeError", "absent"]
