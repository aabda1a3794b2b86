"""FP8 stages under a real 2-rank zero-bubble pipeline: B/W split (W deferred) equals unsplit (BW)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mt_dualpipe.fp8 import FP8Linear

torch.set_num_threads(1)

M = 4  # micro-batches
ROWS = 8  # rows per micro-batch


def _stage() -> nn.Module:
    """Only FP8Linear owns parameters, so the runtime takes the WeightGradStore fast path."""
    return nn.Sequential(FP8Linear(128, 256, backend="emulated"), nn.GELU(), FP8Linear(256, 128, backend="emulated"))


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _worker(rank: int, world: int, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """One step under zb-h1 (B, then W from the store) and one under 1f1b (BW), from the same weights."""
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime.stage import supports_fast_split

    out = {}
    for schedule in ("zb-h1", "1f1b"):
        module = copy.deepcopy(layers[rank])
        assert supports_fast_split(module)
        pipe = Pipeline([module], schedule, timeout=30, fuse_backward=False)  # zb-h1: every B, then its W
        queued = []
        put = pipe.store.put
        pipe.store.put = lambda fn, put=put, queued=queued: (queued.append(fn), put(fn))  # count deferred Ws
        inputs = (x,) if rank == 0 else ()
        labels = (y,) if rank == world - 1 else ()
        loss, _ = pipe.step(*inputs, num_chunks=M, criterion=_criterion, labels=labels)
        assert len(pipe.store) == 0, "every deferred weight gradient must have run by the end of the step"
        out[schedule] = {"loss": loss, "grads": [p.grad.clone() for p in module.parameters()], "deferred": len(queued)}
    return out


def _reference(layers, x, y):
    layers = copy.deepcopy(layers)
    losses = []
    for xm, ym in zip(torch.tensor_split(x, M), torch.tensor_split(y, M), strict=True):
        loss = _criterion(layers[1](layers[0](xm)), ym)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), [[p.grad for p in layer.parameters()] for layer in layers]


@pytest.mark.slow
def test_zero_bubble_split_equals_unsplit_with_fp8_layers():
    dist_utils = pytest.importorskip("tests.helpers.dist")
    torch.manual_seed(0)
    layers = [_stage(), _stage()]
    x, y = torch.randn(M * ROWS, 128), torch.randn(M * ROWS, 128)
    ref_loss, ref_grads = _reference(layers, x, y)
    per_rank = dist_utils.run_ranks(_worker, 2, layers, x, y, timeout=90)
    runs = {name: [per_rank[r][name] for r in range(2)] for name in ("zb-h1", "1f1b")}
    assert [r["deferred"] for r in runs["zb-h1"]] == [2 * M, 2 * M], "each B must queue both layers' dW"
    assert [r["deferred"] for r in runs["1f1b"]] == [0, 0], "BW computes dW at once"
    for name, results in runs.items():
        torch.testing.assert_close(results[1]["loss"], ref_loss, rtol=0, atol=0, msg=name)
        for rank in range(2):
            for got, want in zip(results[rank]["grads"], ref_grads[rank], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{name} rank {rank}")
    # split (B now, W later) and unsplit (BW) agree with each other, not only with the reference
    for rank in range(2):
        for a, b in zip(runs["zb-h1"][rank]["grads"], runs["1f1b"][rank]["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
