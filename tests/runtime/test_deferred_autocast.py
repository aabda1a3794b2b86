"""``DeferredLinear`` under PyTorch's autocast pattern: forward inside ``torch.autocast``, backward
outside. B and W must run their GEMMs in the forward's dtype and give exactly what ``nn.Linear``
gives, both when the weight gradient runs at once and when it is deferred to W."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime.deferred import DeferredLinear
from mt_dualpipe.runtime.weight_grad import WeightGradStore


@pytest.mark.parametrize("deferred_w", [False, True])
def test_deferred_linear_under_autocast_matches_nn_linear(deferred_w):
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref.load_state_dict(lin.state_dict())
    mod = nn.Sequential(DeferredLinear.from_linear(lin[0]), lin[1], DeferredLinear.from_linear(lin[2]))
    x = torch.randn(5, 8, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = mod(x), ref(xr)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_ref)
    out_ref.float().square().sum().backward()
    store = WeightGradStore()
    if deferred_w:
        with store.deferring("B"):
            out.float().square().sum().backward()
        assert all(p.grad is None for p in mod.parameters())  # left for W
        store.run("B")
    else:
        out.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, xr.grad)
    for p, r in zip(mod.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, r.grad)
