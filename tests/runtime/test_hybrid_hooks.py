"""Deferred W goes through autograd's accumulation: post-accumulate-grad hooks fire at W, never in B.

Two pipeline ranks (zb-h1, split backward) with ``DeferredLinear`` layers: every parameter's
``register_post_accumulate_grad_hook`` fires exactly once per micro-batch, always with a
gradient, and the gradient it sees on its last call is the final one (equal to the reference).
"""

from __future__ import annotations

from mt_dualpipe.runtime import Pipeline, defer_weight_grads
from tests.helpers.dist import run_ranks
from tests.helpers.models import criterion, make_data, make_layers, reference

M = 4


def _worker(rank: int, world: int, deferred: bool) -> dict:
    layers = make_layers(2)
    if deferred:
        for layer in layers:
            defer_weight_grads(layer)
    mine = layers[rank]
    calls: dict[str, list] = {}
    for name, p in mine.named_parameters():
        calls[name] = []
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: calls[name].append(None if p.grad is None else p.grad.detach().clone()))
    pipe = Pipeline([mine], "zb-h1")
    x, y = make_data(M)
    pipe.step(x if rank == 0 else None, num_chunks=M, criterion=criterion if rank == 1 else None,
              labels=(y,) if rank == 1 else ())
    _, _, grads = reference(make_layers(2), x, y, M)
    final = {n: (calls[n][-1] - g).abs().max().item() for n, g in zip(calls, grads[rank])}
    return {"counts": {n: len(v) for n, v in calls.items()},
            "nones": sum(v is None for vs in calls.values() for v in vs), "final": final}


def test_post_accumulate_hooks_fire_once_per_w_with_the_gradient() -> None:
    for deferred in (True, False):
        out = run_ranks(_worker, 2, deferred, timeout=60)
        for o in out:
            assert o["nones"] == 0, (deferred, o)
            assert set(o["counts"].values()) == {M}, (deferred, o)
            assert max(o["final"].values()) < 1e-12, (deferred, o)
