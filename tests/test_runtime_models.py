"""Tiny fp64 models, the single-process reference, the per-rank worker of the runtime tests, and
single-process tests of the split backward (B then W must equal one full backward)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe.runtime.backward import full_backward, split_backward
from mt_dualpipe.runtime.stage import supports_fast_split

H = 8
ROWS = 2  # rows per micro-batch


class MLPStage(nn.Module):
    def __init__(self, h: int = H):
        super().__init__()
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(2 * h, h)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def make_layers(n: int, seed: int = 0, cls=MLPStage) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [cls().double() for _ in range(n)]


def make_data(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(m * ROWS, H, generator=g, dtype=torch.float64))


def criterion(out, target):
    return F.mse_loss(out, target)


def reference(layers: list[nn.Module], x: torch.Tensor, labels: torch.Tensor, m: int):
    """Per-micro-batch losses, outputs, and the gradients of their sum, on one process."""
    layers = copy.deepcopy(layers)
    losses, outs = [], []
    for xm, lm in zip(torch.tensor_split(x, m), torch.tensor_split(labels, m)):
        h = xm
        for layer in layers:
            h = layer(h)
        loss = criterion(h, lm)
        loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    grads = [[p.grad.clone() for p in layer.parameters()] for layer in layers]
    return torch.stack(losses), outs, grads


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def chain_batch(sched, chain: int, x: torch.Tensor, m: int) -> torch.Tensor:
    parts = torch.tensor_split(x, m)
    return torch.cat([parts[i] for i in sched.microbatches_of(chain)])


def pipeline_worker(rank: int, world: int, sched, layers, x, labels, infer: bool = False):
    """Run one training step (and optionally an inference step) of ``sched``; return what the test checks."""
    from mt_dualpipe import Pipeline

    local = sched.local_stages(rank)
    mods = [copy.deepcopy(layers[s]) for _, s in local]
    pipe = Pipeline(mods, sched, timeout=30)
    m = sched.num_microbatches
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    inp = (chain_batch(sched, first[0], x, m),) if first else ()
    lab = (chain_batch(sched, last[0], labels, m),) if last else ()
    loss, outs = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
    result = {"local": local, "loss": loss, "outputs": outs, "peak": pipe.peak_activations,
              "grads": [[p.grad for p in mod.parameters()] for mod in mods], "chain_end": last}
    if infer:
        with torch.no_grad():
            iloss, iouts = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
        result["infer"] = (iloss, iouts)
        result["grads_after_infer"] = [[p.grad for p in mod.parameters()] for mod in mods]
    return result


def check_against_reference(sched, results, layers, x, labels, tol: float = 1e-12) -> None:
    """Losses bit-equal, outputs equal, every summed stage gradient within ``tol`` cosine difference."""
    m = sched.num_microbatches
    ref_loss, ref_outs, ref_grads = reference(layers, x, labels, m)
    n_stages = len(sched.placement[0])
    summed: dict[int, list] = {}
    for res in results:
        for (_, s), grads in zip(res["local"], res["grads"]):
            if s not in summed:
                summed[s] = [g.clone() for g in grads]
            else:
                summed[s] = [a + b for a, b in zip(summed[s], grads)]
        for c in res["chain_end"]:
            mbs = sched.microbatches_of(c)
            assert torch.equal(res["loss"], ref_loss[mbs]), f"{sched.name}: loss differs"
            assert torch.equal(res["outputs"], torch.cat([ref_outs[i] for i in mbs])), f"{sched.name}: outputs"
    assert sorted(summed) == list(range(n_stages))
    for s in range(n_stages):
        for g, r in zip(summed[s], ref_grads[s]):
            assert cos_diff(g, r) < tol, f"{sched.name} stage {s}: grad cos diff {cos_diff(g, r)}"


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
    from mt_dualpipe.integrations import __name__ as _  # noqa: F401  (package importable)

    class Deferred(nn.Linear):
        supports_deferred_weight_grad = True

    assert supports_fast_split(nn.Sequential(Deferred(2, 2), nn.GELU(), Deferred(2, 2)))
    assert not supports_fast_split(nn.Sequential(Deferred(2, 2), nn.Linear(2, 2)))
    assert not supports_fast_split(nn.GELU())
