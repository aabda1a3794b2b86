"""Dense vs expert gradient groups on dp=2 x ep=2 (4 gloo ranks) with a toy expert-parallel layer.

Each rank holds the dense layer and one expert (expert e on ep rank e). A rank's rows go, by
position, half to expert 0 and half to expert 1 through a differentiable all-to-all over the ep
group, so an expert's gradient on one rank already sums both ep ranks' tokens. Dense gradients
then average over dp x ep and expert gradients sum over dp and divide by dp x ep
(``ParallelDims.grad_group``); both must equal the single-process gradients of the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dnn
import torch.nn as nn

from mt_dualpipe.parallel import GradSync, init_parallel
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import H, global_batch, local_loss

ROWS = 4  # rows per rank: 2 to each expert


def _layers(seed: int = 0) -> tuple[nn.Linear, list[nn.Linear]]:
    torch.manual_seed(seed)
    return nn.Linear(H, H).double(), [nn.Linear(H, H).double() for _ in range(2)]


def _worker(rank: int, world: int) -> dict:
    dims = init_parallel(dp=2, ep=2)
    ep, ep_group = dims.coord("ep"), dims.group("ep")
    dense, experts = _layers()
    expert = experts[ep]
    x, y = global_batch(1, world * ROWS)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    h = torch.tanh(dense(x[mine]))
    routed = dnn.all_to_all_single(torch.empty_like(h), h, group=ep_group)  # rows for my expert
    done = dnn.all_to_all_single(torch.empty_like(routed), expert(routed), group=ep_group)
    local_loss(done, y[mine], ROWS).backward()
    syncs = [GradSync(dense, dims.grad_group("dense").group, divide_by=dims.grad_group("dense").divide_by),
             GradSync(expert, dims.grad_group("expert").group, divide_by=dims.grad_group("expert").divide_by)]
    for s in syncs:
        s.start()
    for s in syncs:
        s.wait()
    return {"ep": ep, "dense": [p.grad for p in dense.parameters()], "expert": [p.grad for p in expert.parameters()]}


def _reference(world: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    dense, experts = _layers()
    x, y = global_batch(1, world * ROWS)
    h = torch.tanh(dense(x)).view(world, 2, ROWS // 2, H)  # (rank, expert, row, H): by position
    out = torch.stack([experts[0](h[:, 0]), experts[1](h[:, 1])], dim=1).reshape(world * ROWS, H)
    local_loss(out, y, world * ROWS).backward()
    return [p.grad for p in dense.parameters()], [[p.grad for p in e.parameters()] for e in experts]


def test_dense_over_dp_ep_and_expert_over_dp_divided_by_dp_ep():
    out = run_ranks(_worker, 4, timeout=90)
    dense_ref, expert_ref = _reference(4)
    assert [r["ep"] for r in out] == [0, 1, 0, 1]
    for r in out:
        for got, want in zip(r["dense"], dense_ref):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        for got, want in zip(r["expert"], expert_ref[r["ep"]]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
