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


def test_a_reentrant_checkpoint_that_would_lose_its_gradients_is_refused():
    """Inputs that need no gradient (a first stage's batch): torch's reentrant checkpoint makes an output
    that needs none either, so its parameters would silently get no gradient; the step stops instead."""
    stage = Stage(Checkpointed(reentrant=True), 0, 0, True, False, WeightGradStore(), rank=0)
    with pytest.raises(Exception) as info:
        stage.forward(0, (torch.randn(3, 4),), None, (), True, False)
    assert type(info.value).__name__ == "PipelineError"
    assert str(info.value) == (
        "rank 0 F(chain 0, stage 0, mb 0) in Checkpointed: torch.utils.checkpoint(use_reentrant=True) got inputs "
        "none of which requires grad, so the parameters inside it would get no gradient (torch's reentrant "
        "checkpoint); use torch.utils.checkpoint(..., use_reentrant=False) or checkpoint_wrapper(..., "
        "checkpoint_impl=CheckpointImpl.NO_REENTRANT)")
    # the non-reentrant one has no such hole: its parameters get their gradients from the same inputs
    ok = Stage(Checkpointed(reentrant=False), 0, 0, True, False, WeightGradStore(), rank=0)
    ok.forward(0, (torch.randn(3, 4),), None, (), True, False)
    ok.backward(0, [torch.ones(3, 4)], split=False)
    assert all(p.grad is not None for p in ok.module.parameters())


class Warns(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        import warnings

        warnings.warn("a user warning", UserWarning, stacklevel=1)
        return self.a(x)


def test_other_warnings_of_a_forward_still_reach_the_user_once():
    import warnings

    stage = Stage(Warns(), 0, 0, True, False, WeightGradStore())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: once per place
        for mb in range(3):
            stage.forward(mb, (torch.randn(2, 4),), None, (), True, False)
    assert [(str(w.message), w.category) for w in seen] == [("a user warning", UserWarning)]
