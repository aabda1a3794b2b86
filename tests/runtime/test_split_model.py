"""``split_model`` cuts a stack of layers into a schedule's stages (balanced by parameter count or
given costs) and gives a rank its own; ``Pipeline.needs_inputs`` / ``needs_labels`` say where the
batch's inputs and labels go. A model split this way trains to the gradients of one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import mt_dualpipe
from mt_dualpipe.runtime.errors import PipelineError
from mt_dualpipe.runtime.split import balanced_cuts, split_model
from tests.helpers.dist import run_ranks


def _layers(widths):
    torch.manual_seed(0)
    return [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]


def test_balanced_cuts_minimise_the_largest_stage():
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]   # 5 | 5 beats 6 | 4
    assert balanced_cuts([1, 2, 3, 4, 5], 3) == [0, 3, 4, 5]   # max 6 = 1+2+3 | 4 | 5
    assert balanced_cuts([0, 0, 7], 3) == [0, 1, 2, 3]         # every stage gets a layer


def test_split_model_by_parameter_count_and_by_cost():
    layers = _layers([4, 32, 4, 4, 4, 4])  # parameters: 160, 132, 20, 20, 20
    # 1f1b on 2 ranks: two stages; by parameters {160} | {132, 20, 20, 20}
    first = split_model(nn.Sequential(*layers), "1f1b", 0, 2)
    second = split_model(layers, "1f1b", 1, 2)
    assert [list(m) for m in first] == [layers[:1]] and [list(m) for m in second] == [layers[1:]]
    assert all(isinstance(m, nn.Sequential) for m in first + second)
    # zbv on 2 ranks: four stages in a V, rank 0 holds stages 0 and 3; costs instead of parameters
    mods = split_model(layers, "zbv", 0, 2, costs=[3, 2, 3, 1, 4])
    assert [list(m) for m in mods] == [layers[0:1], layers[4:5]]  # the one cut with max 4: 3 | 2 | 3+1 | 4
    assert mt_dualpipe.split_model is split_model


def test_split_model_refuses_bad_input():
    layers = _layers([4, 4, 4])
    with pytest.raises(PipelineError, match=r"the model has 2 layer\(s\) but the schedule on 2 ranks has 4 stages "
                                            r"per chain; give at least one layer per stage"):
        split_model(layers, "zbv", 0, 2)
    with pytest.raises(PipelineError, match=r"costs must be 2 non-negative numbers, one per layer; got \[1\]"):
        split_model(layers, "1f1b", 0, 2, costs=[1])
    with pytest.raises(PipelineError, match="unknown schedule 'nope'"):
        split_model(layers, "nope", 0, 2)
    with pytest.raises(PipelineError, match=r"rank must be in 0..1, got 2"):
        split_model(layers, "1f1b", 2, 2)


def _worker(rank, world):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.resilience import fresh_group

    out = {}
    for name in ("1f1b", "zbv", "dualpipe"):
        pipe = Pipeline(split_model(_layers([4] * 5), name, rank), name, fresh_group())
        out[name] = (pipe.needs_inputs, pipe.needs_labels)
    layers = [layer.double() for layer in _layers([4, 8, 8, 4, 4])]
    ref = copy.deepcopy(layers)
    pipe = Pipeline(split_model(layers, "zbv", rank), "zbv", fresh_group())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
    pipe.step(*((x,) if pipe.needs_inputs else ()), num_chunks=4, criterion=nn.functional.mse_loss,
              labels=(y,) if pipe.needs_labels else ())
    for xm, ym in zip(x.tensor_split(4), y.tensor_split(4)):
        nn.functional.mse_loss(nn.Sequential(*ref)(xm), ym).backward()
    mine = [p for m in pipe.module for p in m.parameters()]
    owned = {id(p) for p in mine}
    out["grads"] = all(torch.allclose(p.grad, r.grad, rtol=0, atol=1e-12)
                       for lay, rlay in zip(layers, ref) for p, r in zip(lay.parameters(), rlay.parameters())
                       if id(p) in owned)
    out["owned"] = len(mine)
    return out


def test_needs_inputs_and_labels_and_a_split_model_trains_like_one_process():
    res = run_ranks(_worker, 2, timeout=120)
    assert [r["1f1b"] for r in res] == [(True, False), (False, True)]
    assert [r["zbv"] for r in res] == [(True, True), (False, False)]
    assert [r["dualpipe"] for r in res] == [(True, True), (True, True)]
    assert all(r["grads"] for r in res) and sum(r["owned"] for r in res) == 4 * 2  # 4 linears, weight + bias
