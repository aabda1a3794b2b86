"""init_parallel: rank order, groups per weight kind, mirrored-stage groups and bad input."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mt_dualpipe.parallel import init_parallel
from tests.helpers.dist import run_ranks


def _ranks(group) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


def _layout(rank: int, world: int, pp: int, dp: int, ep: int) -> dict:
    dims = init_parallel(pp=pp, dp=dp, ep=ep)
    out = {"coords": tuple(dims.coord(d) for d in ("pp", "dp", "ep", "tp")),
           "groups": {d: _ranks(dims.group(d)) for d in ("pp", "dp", "ep", "tp")},
           "dense": (dims.grad_group("dense").ranks, dims.grad_group("dense").divide_by),
           "expert": (dims.grad_group("expert").ranks, dims.grad_group("expert").divide_by),
           "backend": dims.backend, "device": dims.device_type}
    # the dense group really reduces over its ranks
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=dims.grad_group("dense").group)
    out["dense_sum"] = t.item()
    mirrored = dims.stage_sync_groups([(0, pp - 1), (pp - 1, 0)] if pp > 1 else [(0,)])
    out["mirrored"] = {s: (g.ranks, g.divide_by) for s, g in mirrored.items()}
    return out


def test_pp2_dp2_rank_order_and_groups():
    out = run_ranks(_layout, 4, 2, 2, 1, timeout=60)
    for rank, r in enumerate(out):
        pp, dp = divmod(rank, 2)  # pp outermost: rank = pp * dp_size + dp
        assert r["coords"] == (pp, dp, 0, 0)
        assert r["groups"] == {"pp": (dp, dp + 2), "dp": (2 * pp, 2 * pp + 1), "ep": (rank,), "tp": (rank,)}
        assert r["dense"] == ((2 * pp, 2 * pp + 1), 2)
        assert r["expert"] == ((2 * pp, 2 * pp + 1), 2)
        assert r["dense_sum"] == float(4 * pp + 1)
        # DualPipe: both stages are held by pp 0 and 1 -> one group of all 4 ranks each, / dp
        assert r["mirrored"] == {0: ((0, 1, 2, 3), 2), 1: ((0, 1, 2, 3), 2)}
        assert (r["backend"], r["device"]) == ("gloo", "cpu")


def test_dp2_ep2_dense_over_dp_times_ep_expert_over_dp():
    out = run_ranks(_layout, 4, 1, 2, 2, timeout=60)
    for rank, r in enumerate(out):
        dp, ep = divmod(rank, 2)  # ep inside dp
        assert r["coords"] == (0, dp, ep, 0)
        assert r["groups"]["ep"] == (2 * dp, 2 * dp + 1)
        assert r["groups"]["dp"] == (ep, ep + 2)
        assert r["dense"] == ((0, 1, 2, 3), 4)            # dense weights: every replica of them
        assert r["expert"] == ((ep, ep + 2), 4)            # expert e: summed over the dp ranks holding it, / dp*ep
        assert r["dense_sum"] == 6.0
        assert r["mirrored"] == {0: ((0, 1, 2, 3), 4)}     # one pp rank: the plain dense group


def _bad(rank: int, world: int) -> list[str]:
    msgs = []
    for kwargs in ({"pp": 3, "dp": 1}, {"pp": 2, "dp": 2, "ep": 2}, {"pp": 0}, {"pp": 2, "backend": "nccl"},
                   {"pp": 2, "backend": "mpi"}):
        try:
            init_parallel(**kwargs)
        except ValueError as exc:
            msgs.append(str(exc))
    dims = init_parallel(pp=2)
    for call in (lambda: dims.group("cp"), lambda: dims.grad_group("moe"),
                 lambda: dims.stage_sync_groups([(0, 0)]), lambda: dims.stage_sync_groups([(2,)])):
        try:
            call()
        except ValueError as exc:
            msgs.append(str(exc))
    return msgs


def test_bad_input_names_the_numbers():
    msgs = run_ranks(_bad, 2, timeout=60)[0]
    assert msgs == [
        "world size 2 != pp*dp*ep*tp = 3*1*1*1 = 3",
        "world size 2 != pp*dp*ep*tp = 2*2*2*1 = 8",
        "parallel sizes must be positive integers, got {'pp': 0}",
        "backend 'nccl' requested but the default process group uses 'gloo'",
        "unknown backend 'mpi'; supported: gloo, nccl, mccl",
        "unknown mesh dimension 'cp'; allowed: pp, dp, ep, tp",
        "unknown weight kind 'moe'; allowed: dense, expert",
        "stage 0: holders [0, 0] must be distinct pipeline ranks in [0, 2)",
        "stage 0: holders [2] must be distinct pipeline ranks in [0, 2)",
    ]
