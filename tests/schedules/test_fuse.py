"""``fuse_adjacent_backward``: a B directly followed by its own W (no transfer between) becomes one BW; nothing
else of the program moves, and the fused run's gradients are the split run's, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe.schedules import build_schedule
from mt_dualpipe.schedules.fuse import executed_schedule, fuse_adjacent_backward
from mt_dualpipe.schedules.ir import FB, CommBatch, Op
from mt_dualpipe.schedules.lower import lower
from mt_dualpipe.schedules.ops import BW, B, W
from mt_dualpipe.schedules.validate import check_structure
from tests.helpers.dist import run_ranks


def _expected(ops: list) -> tuple[list, int]:
    """The program a hand walk gives: each B (or FB ending in a B) followed at once by its own W merges."""
    out, i, fused = [], 0, 0
    while i < len(ops):
        item, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        b = item.b if type(item) is FB else item
        if (type(b) is Op and b.kind == B and type(nxt) is Op and nxt.kind == W
                and (nxt.chain, nxt.stage, nxt.mb) == (b.chain, b.stage, b.mb)):
            bw = Op(BW, b.chain, b.stage, b.mb)
            out.append(FB(item.f, bw) if type(item) is FB else bw)
            fused, i = fused + 1, i + 2
        else:
            out.append(item)
            i += 1
    return out, fused


@pytest.mark.parametrize("name,P,M", [("zbv", 4, 8), ("zb-h1", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 4, 8),
                                      ("zbv", 1, 4), ("1f1b", 4, 8)])
def test_only_a_b_followed_by_its_own_w_with_nothing_between_fuses(name, P, M):
    program = lower(build_schedule(name, P, M))
    fused = fuse_adjacent_backward(program)
    total = 0
    for r in range(P):
        want, n = _expected(program.ranks[r])
        assert fused.ranks[r] == want
        total += n
        # the transfers are posted in the same order, at the same places between compute ops
        assert [i for i in fused.ranks[r] if type(i) is CommBatch] == \
            [i for i in program.ranks[r] if type(i) is CommBatch]
    check_structure(fused.compute_schedule())  # still a valid schedule: every op's dependencies hold
    assert executed_schedule(build_schedule(name, P, M)).ranks == fused.compute_schedule().ranks
    if name == "1f1b":
        assert total == 0 and fused is program  # no W at all: the program itself comes back
    elif P == 1:  # one rank: no transfer anywhere, so every W directly after its B fuses, and none is left
        assert total > 0 and not any(getattr(i, "kind", None) == W for i in fused.ranks[0])
    else:
        assert total > 0
    if (name, P) == ("zbv", 4):  # 12 of 64 Ws: elsewhere B's gradient leaves the rank, or a receive is posted
        assert total == 12


def _stage(width: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


def _fused_vs_split(rank: int, world: int, name: str) -> dict:
    from mt_dualpipe import Pipeline

    torch.manual_seed(0)
    sched = build_schedule(name, world, 4)
    stages = [_stage(8) for _ in range(sched.num_stages())]
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    grads, kinds = {}, {}
    for fuse in (True, False):
        mods = [copy.deepcopy(stages[s]) for _, s in sched.local_stages(rank)]
        pipe = Pipeline(mods, sched, timeout=30, fuse_backward=fuse)
        pipe.record_timeline = True
        first = any(ch[0] == rank for ch in sched.placement)
        last = any(ch[-1] == rank for ch in sched.placement)
        loss, _ = pipe.step(*((x,) if first else ()), num_chunks=4, criterion=F.mse_loss,
                            labels=(y,) if last else ())
        grads[fuse] = [p.grad.clone() for m in mods for p in m.parameters()]
        kinds[fuse] = [e.op for e in pipe.timeline.events if e.rank == rank] if pipe.timeline is not None else None
    return {"equal": all(torch.equal(a, b) for a, b in zip(grads[True], grads[False])), "kinds": kinds}


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_fused_backward_gives_the_split_gradients_bit_for_bit(name):
    res = run_ranks(_fused_vs_split, 2, name, timeout=120)
    assert all(r["equal"] for r in res)
    kinds = res[0]["kinds"]  # the timeline is gathered on rank 0
    assert kinds[True].count(BW) > kinds[False].count(BW) and kinds[True].count(W) < kinds[False].count(W)
