"""An output whose gradient is None in one step and a tensor in the next (or the other way round).

A stage returns ``(h, aux)`` and the criterion uses ``aux`` only in some steps, so the last stage's
B gives ``aux``'s input no gradient in those steps. The message back to the first stage must keep
one layout from step to step (zeros stand for "no gradient"), and the gradients must be those of
one process running the same steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.helpers.dist import run_ranks

DIM, ROWS, CHUNKS = 4, 8, 2


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.a(x), self.b(x)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(DIM, DIM)

    def forward(self, h, aux):
        return self.c(h), aux * 2


def plain(out, aux, y):
    return ((out - y) ** 2).mean()


def with_aux(out, aux, y):
    return ((out - y) ** 2).mean() + aux.pow(2).mean()


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Split().double(), Head().double()]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(ROWS, DIM, generator=g, dtype=torch.float64),
            torch.randn(ROWS, DIM, generator=g, dtype=torch.float64))


def _reference(criteria) -> list[list[list[torch.Tensor]]]:
    """Per step, per stage: the gradients of the summed micro-batch losses, on one process."""
    mods = _modules()
    out = []
    for step, crit in enumerate(criteria):
        for m in mods:
            m.zero_grad(set_to_none=True)
        x, y = _data(step)
        for xm, ym in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS)):
            crit(*mods[1](*mods[0](xm)), ym).backward()
        out.append([[p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
                    for m in mods])
    return out


def _worker(rank, world, orders):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.resilience import fresh_group

    results = []
    for criteria in orders:
        mod = copy.deepcopy(_modules()[rank])
        pipe = Pipeline([mod], "1f1b", fresh_group(), timeout=30)
        grads = []
        for step, crit in enumerate(criteria):
            mod.zero_grad(set_to_none=True)
            x, y = _data(step)
            pipe.step(*((x,) if rank == 0 else ()), num_chunks=CHUNKS, criterion=crit,
                      labels=(y,) if rank == 1 else ())
            grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in mod.parameters()])
        ref = _reference(criteria)
        results.append([all(torch.allclose(g, r, rtol=0, atol=1e-12) for g, r in zip(grads[s], ref[s][rank]))
                        for s in range(len(criteria))])
    return results


def test_an_output_gradient_that_comes_and_goes_matches_one_process():
    orders = [(plain, with_aux, plain), (with_aux, plain, with_aux)]
    res = run_ranks(_worker, 2, orders, timeout=120)
    for rank in range(2):
        assert res[rank] == [[True, True, True], [True, True, True]], (rank, res[rank])
