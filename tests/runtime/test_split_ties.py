"""``split_model``: weights that layers on different stages share are found by identity and tied under every
schedule (no silent wrong gradient); a ``tied_parameters`` declaration that ties nothing is refused on every rank;
stages take and return several tensors. On 2 gloo ranks, float64, against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime.split import SplitStage, shared_parameters, split_model
from tests.helpers.dist import run_ranks

VOCAB, HIDDEN, M = 16, 8, 4
SCHEDULES = ("1f1b", "zbv", "dualpipev", "dualpipe")


class Embed(nn.Module):
    """Token ids -> (hidden, mask): the mask rides along to every later layer."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table(ids) * mask.unsqueeze(-1), mask


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.tanh(self.proj(h)) * mask.unsqueeze(-1), mask


class TiedHead(nn.Module):
    """The output projection reads the embedding table (the same Parameter object)."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h @ self.table.weight.t()


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    table = nn.Embedding(VOCAB, HIDDEN)
    return [m.double() for m in (Embed(table), Mixer(), Mixer(), Mixer(), TiedHead(table))]


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * M, 5), generator=g)
    mask = (torch.rand(2 * M, 5, generator=g) > 0.2).double()
    return ids, mask, torch.randint(0, VOCAB, (2 * M, 5), generator=g)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _reference() -> dict[str, torch.Tensor]:
    layers = _layers()
    ids, mask, target = _data()
    model = SplitStage(*layers)
    for m in range(M):  # the pipeline's loss: each micro-batch's mean, backpropagated as is
        rows = slice(2 * m, 2 * m + 2)
        _loss(model(ids[rows], mask[rows]), target[rows]).backward()
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()}


def _worker(rank: int, world: int) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.schedules.registry import build_schedule

    out = {}
    for name in SCHEDULES:
        sched = build_schedule(name, world, M)
        layers = _layers()
        stages = split_model(layers, sched, rank)
        ids, mask, target = _data()
        first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
        last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
        rows = [torch.cat([torch.arange(2 * m, 2 * m + 2) for m in sched.microbatches_of(c)])
                for c in range(len(sched.placement))]
        inputs = (ids[rows[first[0]]], mask[rows[first[0]]]) if first else ()
        labels = (target[rows[last[0]]],) if last else ()
        Pipeline(stages, sched, timeout=60).step(*inputs, num_chunks=M, criterion=_loss, labels=labels)
        # every rank holds the whole model's layer objects; its stages' parameters got their gradients
        out[name] = {"ties": [dict(st.tied_parameters) for st in stages],
                     "grads": {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers)
                               for n, p in layer.named_parameters() if p.grad is not None
                               and any(p is q for st in stages for q in st.parameters())}}
    return out


def test_shared_weights_are_tied_by_identity_and_several_tensors_flow_under_every_schedule():
    want = _reference()
    per_rank = run_ranks(_worker, 2, timeout=180)
    for name in SCHEDULES:
        got = {}
        for res in per_rank:
            got.update(res[name]["grads"])
        assert got.keys() == want.keys(), name
        for k in want:  # the shared table's gradient is the sum of both uses, whichever ranks hold them
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=f"{name} {k}")
        declared = [t for res in per_rank for t in res[name]["ties"]]
        assert {k for t in declared for k in t.values()} == {"shared.0"}  # the table, under one key everywhere
    # under 1f1b the embedding (stage 0) and the head (stage 1) sit on different ranks: each declares its copy
    (first,), (last,) = per_rank[0]["1f1b"]["ties"], per_rank[1]["1f1b"]["ties"]
    assert first == {"0.table.weight": "shared.0"}
    assert list(last.values()) == ["shared.0"] and next(iter(last)).endswith(".table.weight")


def test_shared_parameters_are_found_by_identity():
    layers = _layers()
    assert shared_parameters(layers) == {id(layers[0].table.weight): "shared.0"}
    assert shared_parameters([nn.Linear(2, 2), nn.Linear(2, 2)]) == {}


class _OneSidedTie(nn.Sequential):
    def __init__(self, declared) -> None:
        super().__init__(nn.Linear(4, 4))
        self.tied_parameters = declared


def _refusing_worker(rank: int, world: int, declared) -> str:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime.errors import PipelineError

    stage = _OneSidedTie(declared if rank == 0 else ())
    try:
        Pipeline([stage], "1f1b", timeout=30)
    except PipelineError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("declared, message", [
    (("0.weight",), "tied parameter '0.weight' is declared by stage 0 only"),
    ({"0.weight": "embed"}, "tied parameter 'embed' is declared by stage 0 only"),
    (("0.wieght",), "tied_parameters names '0.wieght', which no stage module holds"),
])
def test_a_declaration_that_ties_nothing_is_refused_on_every_rank(declared, message):
    for text in run_ranks(_refusing_worker, 2, declared, timeout=60):
        assert message in text
