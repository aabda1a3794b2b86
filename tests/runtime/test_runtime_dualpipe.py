"""DualPipe / DualPipeV used the way deepseek-ai/DualPipe's examples use them: a stage class with
a custom linear that defers its weight gradient, an ``overlapped_forward_backward`` hook, a
training step checked against a single-process run, ``sync_mirrored_grads`` (DualPipe), then an
inference step with ``return_outputs``."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.helpers.dist import run_ranks
from tests.helpers.models import cos_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from toy_pipeline import (  # noqa: E402
    LinearFunc,  # noqa: E402  (the examples' stage: deferred linears + F&B hook)
    criterion,
    ref_step,
)
from toy_pipeline import PipelineStage as _ExampleStage  # noqa: E402

H, ROWS = 8, 2


def PipelineStage() -> _ExampleStage:  # noqa: N802 (a stage of width H, as the examples build it)
    return _ExampleStage(H)


def _dualpipe(rank, P, num_chunks):
    from mt_dualpipe import DualPipe

    torch.manual_seed(233)
    full = nn.Sequential(*[PipelineStage() for _ in range(P)]).double()
    full_x = torch.randn(num_chunks * ROWS, H, dtype=torch.float64)
    full_l = torch.randn(num_chunks * ROWS, H, dtype=torch.float64)
    loss_ref, out_ref = ref_step(full_x, full_l, full, num_chunks, criterion)
    local_full = nn.Sequential(full[rank], full[P - 1 - rank])
    local = copy.deepcopy(local_full)
    for p in local.parameters():
        p.grad = None
    model = DualPipe(local, timeout=30)
    model.fuse_backward = False  # the reference examples split every zero-bubble backward
    first, last = rank == 0, rank == P - 1
    x = full_x.chunk(2)[0] if first else full_x.chunk(2)[1] if last else None
    lab = full_l.chunk(2)[1] if first else full_l.chunk(2)[0] if last else None
    _ExampleStage.hook_calls = LinearFunc.deferred = 0
    loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,), return_outputs=False)
    res = {"hook_calls": _ExampleStage.hook_calls, "deferred": LinearFunc.deferred, "outputs": outputs}
    if first:
        res["loss_ok"] = torch.equal(loss, loss_ref.chunk(2)[1])
    elif last:
        res["loss_ok"] = torch.equal(loss, loss_ref.chunk(2)[0])
    else:
        res["loss_ok"] = loss is None
    model.sync_mirrored_grads()
    res["grad_diff"] = max(cos_diff(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters()))
    model.zero_grad()
    with torch.no_grad():
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,), return_outputs=True)
    if first:
        res["infer_ok"] = torch.equal(loss, loss_ref.chunk(2)[1]) and torch.equal(outputs, out_ref.chunk(2)[1])
    elif last:
        res["infer_ok"] = torch.equal(loss, loss_ref.chunk(2)[0]) and torch.equal(outputs, out_ref.chunk(2)[0])
    else:
        res["infer_ok"] = loss is None and outputs is None
    res["grads_untouched"] = all(p.grad is None for p in local.parameters())
    return res


def _dualpipev(rank, P, num_chunks):
    from mt_dualpipe import DualPipeV

    torch.manual_seed(233)
    full = nn.Sequential(*[PipelineStage() for _ in range(2 * P)]).double()
    full_x = torch.randn(num_chunks * ROWS, H, dtype=torch.float64)
    full_l = torch.randn(num_chunks * ROWS, H, dtype=torch.float64)
    loss_ref, out_ref = ref_step(full_x, full_l, full, num_chunks, criterion)
    local_full = nn.Sequential(full[rank], full[2 * P - 1 - rank])
    local = copy.deepcopy(local_full)
    for p in local.parameters():
        p.grad = None
    model = DualPipeV(local, timeout=30)
    model.fuse_backward = False  # the reference examples split every zero-bubble backward
    x, lab = (full_x, full_l) if rank == 0 else (None, None)
    _ExampleStage.hook_calls = LinearFunc.deferred = 0
    loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,), return_outputs=False)
    res = {"hook_calls": _ExampleStage.hook_calls, "deferred": LinearFunc.deferred, "outputs": outputs,
           "loss_ok": torch.equal(loss, loss_ref) if rank == 0 else loss is None}
    res["grad_diff"] = max(cos_diff(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters()))
    model.zero_grad()
    with torch.no_grad():
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,), return_outputs=True)
    res["infer_ok"] = (torch.equal(loss, loss_ref) and torch.equal(outputs, out_ref)) if rank == 0 else \
        (loss is None and outputs is None)
    res["grads_untouched"] = all(p.grad is None for p in local.parameters())
    return res


def _both(rank, P):
    torch.set_num_threads(1)
    return {"dualpipe": _dualpipe(rank, P, 2 * P + 2), "dualpipev": _dualpipev(rank, P, 2 * P + 1)}


@pytest.mark.parametrize("P", [2, 4])
def test_dualpipe_and_dualpipev_like_the_reference_examples(P):
    results = run_ranks(_both, P, timeout=180)
    for kind in ("dualpipe", "dualpipev"):
        for rank, res in enumerate(r[kind] for r in results):
            where = f"{kind} rank {rank}"
            assert res["loss_ok"], where
            assert res["outputs"] is None, where
            assert res["grad_diff"] < 1e-12, (where, res["grad_diff"])
            assert res["infer_ok"], where
            assert res["grads_untouched"], where
            assert res["hook_calls"] > 0, f"{where}: the overlapped_forward_backward hook never ran"
            assert res["deferred"] > 0, f"{where}: no weight gradient went through the WeightGradStore"
