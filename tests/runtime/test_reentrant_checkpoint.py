"""A stage that uses ``torch.utils.checkpoint(..., use_reentrant=True)`` under a split-backward
schedule: torch refuses to split a backward through it, so its B falls back to one full backward
(weight gradients included, with a warning saying to use ``use_reentrant=False``), and B then W
still give exactly the gradients of one plain backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from mt_dualpipe.runtime.stage import Stage
from mt_dualpipe.runtime.weight_grad import WeightGradStore


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_split_backward_through_a_checkpoint_equals_one_backward(reentrant, recwarn):
    torch.manual_seed(0)
    mod = Checkpointed(reentrant).double()
    ref = copy.deepcopy(mod)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    stage = Stage(mod, 0, 1, False, False, WeightGradStore())
    for mb in range(2):  # the fallback is decided once, then reused
        stage.forward(mb, (x.detach().clone().requires_grad_(),), None, (), True, False)
        stage.backward(mb, [g], split=True)
        stage.weight(mb)
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    ref(x.detach().clone().requires_grad_()).backward(g)
    assert torch.equal(stage.input_grads[0][0], xr.grad) and torch.equal(stage.input_grads[1][0], xr.grad)
    for p, r in zip(mod.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=0, atol=1e-14)
    messages = [str(w.message) for w in recwarn if "use_reentrant" in str(w.message)]
    if reentrant:
        assert messages == ["stage (chain 0, stage 1) Checkpointed uses torch.utils.checkpoint(use_reentrant=True), "
                            "whose backward cannot be split: its B computes the weight gradients too (W has "
                            "nothing left). Pass use_reentrant=False to keep them for W."]
    else:
        assert messages == [] and stage.reentrant is False
