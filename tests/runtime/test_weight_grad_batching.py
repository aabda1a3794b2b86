"""W's deferred weight gradients reach ``.grad`` in as few autograd engine calls as the batch bound allows.

One engine call per linear made W on a GPU 1.8x slower than the fused backward (each call hands over to
the device thread); ``run_group`` adds the gradients of parameters nothing observes directly (no engine
call) and batches the observed ones' ``put_grads`` entries into one call per ``ACCUMULATE_BATCH_BYTES``.
Gradients stay those of plain autograd, a weight used twice in one micro-batch gets the sum, and a
post-accumulate hook fires once per W with the accumulated gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime import weight_grad
from mt_dualpipe.runtime.deferred import defer_weight_grads
from mt_dualpipe.runtime.weight_grad import WeightGradStore


def _model(layers: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())])


def _engine_calls(monkeypatch) -> list[int]:
    """The number of parameters of each engine call W makes (``weight_grad`` calls it through ``through_engine``)."""
    calls: list[int] = []
    real = weight_grad.through_engine

    def counting(pairs):
        if pairs:
            calls.append(len(pairs))
        return real(pairs)

    monkeypatch.setattr(weight_grad, "through_engine", counting)
    return calls


def _b_then_w(model: nn.Module, x: torch.Tensor, store: WeightGradStore, calls: list[int]) -> None:
    y = model(x)
    with store.deferring("mb0"), weight_grad.held_post_accumulate_hooks(list(model.parameters())):  # as a B does
        y.sum().backward()
    assert all(p.grad is None for p in model.parameters()), "B must leave every weight gradient to W"
    calls.clear()  # count W's engine calls only
    store.run("mb0")


def _observed(model: nn.Module) -> list[int]:
    """A post-accumulate hook on every parameter (what FSDP or a gradient-sync hook would register)."""
    fired: list[int] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: fired.append(1))
    return fired


@pytest.mark.parametrize("observed", [False, True])
def test_one_w_is_one_engine_call_or_none_and_equals_plain_autograd(monkeypatch, observed):
    """Observed parameters: the six linears' weights and biases in one engine call, each hook once. Unobserved:
    the gradients are added as AccumulateGrad would, with no engine call at all."""
    ref, model = _model(), defer_weight_grads(_model())
    x = torch.randn(4, 16, dtype=torch.float64)
    ref.double()(x).sum().backward()
    store = WeightGradStore()
    model.double()
    fired = _observed(model) if observed else []
    calls = _engine_calls(monkeypatch)
    _b_then_w(model, x, store, calls)
    assert calls == ([12] if observed else [])
    assert len(fired) == (12 if observed else 0)
    assert store.closures_run == 6
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_the_batch_bound_splits_a_w_into_several_calls(monkeypatch):
    model = defer_weight_grads(_model())
    _observed(model)  # only observed parameters go through the engine
    per_linear = (16 * 16 + 16) * 4  # float32 bytes of one linear's weight and bias gradients
    monkeypatch.setattr(weight_grad, "ACCUMULATE_BATCH_BYTES", 2 * per_linear)
    calls = _engine_calls(monkeypatch)
    _b_then_w(model, torch.randn(4, 16), WeightGradStore(), calls)
    assert calls == [4, 4, 4]


def test_a_weight_used_twice_gets_the_sum_and_its_hook_fires_once_per_w():
    torch.manual_seed(0)
    lin = defer_weight_grads(nn.Sequential(nn.Linear(8, 8)))
    ref = nn.Linear(8, 8)
    ref.load_state_dict(lin[0].state_dict())
    seen: list[torch.Tensor] = []
    lin[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(3, 8)
    ref(torch.tanh(ref(x))).sum().backward()
    store = WeightGradStore()
    y = lin(torch.tanh(lin(x)))
    with store.deferring("mb0"), weight_grad.held_post_accumulate_hooks(list(lin.parameters())):
        y.sum().backward()
    assert seen == []
    store.run("mb0")
    assert len(seen) == 1
    torch.testing.assert_close(lin[0].weight.grad, ref.weight.grad)
    torch.testing.assert_close(seen[0], ref.weight.grad)


def test_other_closures_keep_their_place_between_batches():
    order: list[str] = []
    store = WeightGradStore()
    p = nn.Parameter(torch.zeros(2))
    p.register_post_accumulate_grad_hook(lambda t: order.append(f"acc {float(t.grad[0]):g}"))
    with store.deferring("k"):
        store.put_grads((p,), lambda: (torch.ones(2),))
        store.put(lambda: order.append("custom"))
        store.put_grads((p,), lambda: (torch.ones(2),))
    store.run("k")
    assert order == ["acc 1", "custom", "acc 2"]


@pytest.mark.parametrize("bad", [None])
def test_put_grads_outside_a_deferred_b_is_refused(bad):
    with pytest.raises(RuntimeError, match="outside a deferred B"):
        WeightGradStore().put_grads((nn.Parameter(torch.zeros(1)),), lambda: (bad,))
