"""Single-process tests of the split backward (B then W must equal one full backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime.backward import full_backward, split_backward
from mt_dualpipe.runtime.stage import supports_fast_split
from tests.helpers.models import H, MLPStage


# ----- single-process tests of the split backward ----------------------------------------------
class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.p = nn.Parameter(torch.randn(H))

    def forward(self, x, y):
        return self.lin(torch.relu(self.lin(x))) * self.p + y, (x * self.p).sum(-1)


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.register_buffer("scale", torch.full((H,), 0.5))

    def forward(self, x, tokens):
        return torch.sigmoid(self.lin(x) * self.scale) + tokens.unsqueeze(-1), tokens


class HookedIntermediate(nn.Module):
    """A tensor hook on the output of a layer with weights: W must apply it exactly once."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x):
        h = self.up(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 2)
        return self.down(torch.tanh(h))


def _run_split(mod, xs, split):
    mod.zero_grad(set_to_none=True)
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
    out = mod(*xs)
    out = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(5)
    gs = [torch.randn_like(o) if o.is_floating_point() else None for o in out]
    roots = [o for o, g in zip(out, gs) if g is not None]
    gs = [g for g in gs if g is not None]
    if not split:
        return full_backward(roots, gs, xs), [p.grad.clone() for p in mod.parameters()], None
    ig, w = split_backward(roots, gs, xs)
    after_b = [None if p.grad is None else p.grad.clone() for p in mod.parameters()]
    if w is not None:
        w.run()
    return ig, [p.grad.clone() for p in mod.parameters()], after_b


@pytest.mark.parametrize("make", [lambda: MLPStage().double(), lambda: SharedWeight().double(),
                                  lambda: WithBuffer().double(), lambda: HookedIntermediate().double()])
def test_split_backward_equals_full(make):
    torch.manual_seed(0)
    mod = make()
    xs = [torch.randn(3, H, dtype=torch.float64)]
    if isinstance(mod, SharedWeight):
        xs.append(torch.randn(3, H, dtype=torch.float64))
    if isinstance(mod, WithBuffer):
        xs.append(torch.arange(3))
    ref_in, ref_p, _ = _run_split(mod, xs, False)
    ig, pg, after_b = _run_split(mod, xs, True)
    for a, b in zip(ref_in, ig):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(ref_p, pg):
        assert torch.allclose(a, b, rtol=0, atol=1e-14)
    if isinstance(mod, MLPStage):  # a plain MLP really defers every weight gradient to W
        assert all(g is None for g in after_b)


def test_split_backward_first_stage_defers_everything():
    torch.manual_seed(0)
    mod = MLPStage().double()
    x = torch.randn(3, H, dtype=torch.float64)  # a first stage's input: no grad
    out = mod(x)
    ig, w = split_backward([out], [torch.ones_like(out)], [x])
    assert ig == [None] and all(p.grad is None for p in mod.parameters())
    w.run()
    ref = MLPStage().double()
    ref.load_state_dict(mod.state_dict())
    ref(x).backward(torch.ones_like(out))
    for p, r in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)


def test_fast_split_detection():
    class Deferred(nn.Linear):
        supports_deferred_weight_grad = True

    assert supports_fast_split(nn.Sequential(Deferred(2, 2), nn.GELU(), Deferred(2, 2)))
    assert not supports_fast_split(nn.Sequential(Deferred(2, 2), nn.Linear(2, 2)))
    assert not supports_fast_split(nn.GELU())


class _OpaqueLinear(torch.autograd.Function):
    """A weighted op whose backward computes every gradient at once (as a compiled block's does)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class OpaqueStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(_OpaqueLinear.apply(x, self.w))


def test_an_opaque_node_computes_its_weight_gradients_in_b_says_so_once_and_stays_exact():
    """A custom autograd.Function's backward computes every gradient at once: B captures its weight's
    gradient (W re-running it would repeat B), W only accumulates it, and the stage says so once."""
    import warnings

    from mt_dualpipe.runtime.stage import Stage
    from mt_dualpipe.runtime.weight_grad import WeightGradStore

    torch.manual_seed(0)
    stage = Stage(OpaqueStage(), 0, 1, False, False, WeightGradStore())
    ref = OpaqueStage()
    ref.load_state_dict(stage.module.state_dict())
    g = torch.randn(3, H, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mb in range(2):
            x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(mb))
            stage.forward(mb, (x.requires_grad_(),), None, (), True, False)
            stage.backward(mb, [g], split=True)
            assert mb == 1 or stage.module.w.grad is None  # captured in B, not accumulated
            stage.weight(mb)
            ref(x.detach().clone().requires_grad_()).backward(g)
    said = [str(w.message) for w in seen if "OpaqueStage" in str(w.message)]
    assert said == [
        "stage (chain 0, stage 1) OpaqueStage: the weight gradients of w are computed in B, not W: they are below "
        "_OpaqueLinearBackward, a custom autograd.Function (a torch.compile'd region holding a matrix product is "
        "one) whose backward computes every gradient at once, so W only accumulates them. Give its matrix products "
        "their own autograd nodes (an nn.Linear outside the autograd.Function) or defer them "
        "(mt_dualpipe.runtime.defer_weight_grads) to run them in W."]
    assert torch.allclose(stage.module.w.grad, ref.w.grad, rtol=0, atol=1e-13)


class TwiceUsed(nn.Module):
    """One linear applied twice on the input path: two frontier nodes reach its weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H).double()

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def test_a_weight_two_nodes_reach_falls_back_to_a_full_b_and_says_so_once():
    import warnings

    from mt_dualpipe.runtime.stage import Stage
    from mt_dualpipe.runtime.weight_grad import WeightGradStore

    torch.manual_seed(0)
    stage = Stage(TwiceUsed(), 0, 1, False, False, WeightGradStore())
    ref = TwiceUsed()
    ref.load_state_dict(stage.module.state_dict())
    g = torch.randn(3, H, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mb in range(2):
            x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(mb))
            stage.forward(mb, (x.requires_grad_(),), None, (), True, False)
            stage.backward(mb, [g], split=True)
            assert stage.module.lin.weight.grad is not None  # B computed it
            stage.weight(mb)
            ref(x.detach().clone().requires_grad_()).backward(g)
    said = [str(w.message) for w in seen if "TwiceUsed" in str(w.message)]
    assert said == [
        "stage (chain 0, stage 1) TwiceUsed: the weight gradients of lin.weight, lin.bias are computed in B, not W: "
        "the B/W split falls back to a full backward, since two of its graph's nodes (one is AddmmBackward0) reach "
        "the same weight and one reaches the other, which one W call over both would count twice. Wrap its linears "
        "with mt_dualpipe.runtime.defer_weight_grads to split them anyway."]
    assert torch.allclose(stage.module.lin.weight.grad, ref.lin.weight.grad, rtol=0, atol=1e-13)


class Normed(nn.Module):
    """A norm (vector weights: B computes their gradients, W only accumulates them) before a linear."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(self.norm(x))


@pytest.mark.parametrize("observed", [False, True])
def test_vector_weights_get_their_gradients_in_b_and_reach_grad_at_w(observed):
    """Unobserved, W adds them directly; observed, through the engine, so the hook fires once, at W."""
    torch.manual_seed(0)
    mod = Normed().double()
    ref = Normed().double()
    ref.load_state_dict(mod.state_dict())
    fired: list[torch.Tensor] = []
    if observed:
        mod.norm.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    x = torch.randn(3, H, dtype=torch.float64)
    ref(x).sum().backward()
    xs = x.clone().requires_grad_()
    out = mod(xs)
    ig, w = split_backward([out], [torch.ones_like(out)], [xs])
    assert all(p.grad is None for p in mod.parameters()) and fired == []
    w.run()
    for p, r in zip(mod.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    assert len(fired) == (1 if observed else 0)
    if observed:
        assert torch.equal(fired[0], ref.norm.weight.grad)
