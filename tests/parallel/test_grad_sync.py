"""GradSync and ZeroOptimizer on gloo ranks against the single-process run over the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.parallel import GradSync, ZeroOptimizer, init_parallel, optimizer_state_bytes
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import (
    adamw,
    global_batch,
    local_loss,
    make_model,
    make_optimizer,
    reference,
    reference_grads,
    replica_rows,
)

STEPS = 3
MICRO = 2


def _train(rank: int, world: int, mode: str, bucket_bytes: int, rows: int) -> dict:
    """``STEPS`` AdamW steps of data parallelism over ``world`` replicas, ``MICRO`` micro-batches each."""
    model = make_model()
    sync = GradSync(model, mode=mode, bucket_bytes=bucket_bytes)
    opt = ZeroOptimizer.for_module(model, sync, adamw) if mode == "zero1" else adamw(list(model.parameters()))
    first_grads, grads_none = None, None
    for step in range(STEPS):
        x, y = global_batch(1 + step, rows)
        sl = replica_rows(x, rank, world)
        xs, ys = x[sl], y[sl]
        for xm, ym in zip(xs.chunk(MICRO), ys.chunk(MICRO)):  # accumulate, reduce once per step
            local_loss(model(xm), ym, xs.shape[0]).backward()
        sync.start()
        sync.wait()
        if step == 0:
            if mode == "allreduce":
                first_grads = [p.grad.clone() for p in model.parameters()]
            else:
                grads_none = all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
    state = opt.state_bytes() if mode == "zero1" else optimizer_state_bytes(opt)
    return {"params": [p.detach().clone() for p in model.parameters()], "grads": first_grads,
            "grads_none": grads_none, "state_bytes": state, "posted": sync.collectives_posted,
            "buckets": len(sync.layout.buckets)}


def _both_modes(rank: int, world: int, rows: int, bucket_bytes: int) -> dict:
    return {m: _train(rank, world, m, bucket_bytes, rows) for m in ("allreduce", "zero1")}


def _full_state_bytes() -> tuple[int, int]:
    """(unsharded AdamW state bytes after a step, bytes of its per-parameter ``step`` scalars)."""
    model = make_model()
    opt = make_optimizer("adamw", list(model.parameters()))
    x, y = global_batch(1)
    local_loss(model(x), y, x.shape[0]).backward()
    opt.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    return optimizer_state_bytes(opt), steps


@pytest.mark.parametrize("world,rows", [(2, 16), (3, 12)])
def test_allreduce_and_zero1_equal_single_process_adamw(world, rows):
    out = run_ranks(_both_modes, world, rows, 25 * 2**20, timeout=90)
    torch.manual_seed(0)
    batches = [global_batch(1 + s, rows) for s in range(STEPS)]
    ref = reference(STEPS, "adamw", batches=batches)
    ref_grads = reference_grads() if rows == 16 else None
    full, step_bytes = _full_state_bytes()
    for r in out:
        for mode in ("allreduce", "zero1"):
            for got, want in zip(r[mode]["params"], ref.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
        if ref_grads is not None:
            for got, want in zip(r["allreduce"]["grads"], ref_grads):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        assert r["zero1"]["grads_none"] is True  # only the reduced shard exists after wait()
        assert r["allreduce"]["state_bytes"] == full
        # one bucket holds everything: one collective per step
        assert r["zero1"]["posted"] == STEPS and r["zero1"]["buckets"] == 1
    # ZeRO-1: the per-parameter moments are split over the ranks, only the step scalars repeat
    sharded = [r["zero1"]["state_bytes"] for r in out]
    assert sum(sharded) == full + (world - 1) * step_bytes
    moments = full - step_bytes
    assert max(sharded) - step_bytes <= -(-moments // world) * 1.25  # ~1/dp per rank (rows split unevenly at 3)
    assert max(sharded) / full <= 1 / world + 0.1


def test_small_buckets_give_one_collective_per_parameter_and_same_result():
    out = run_ranks(_both_modes, 2, 16, 1, timeout=90)
    ref = reference(STEPS, "adamw")
    n_params = len(list(ref.parameters()))
    for r in out:
        for mode in ("allreduce", "zero1"):
            assert r[mode]["buckets"] == n_params
            assert r[mode]["posted"] == n_params * STEPS
            for got, want in zip(r[mode]["params"], ref.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)


def _mirrored(rank: int, world: int, mode: str) -> dict:
    """PP2 x DP2 without a pipeline: pp rank 0 and 1 each hold copies of stage 0 and stage 1 (DualPipe).

    Each pp rank runs its chain's half of the replica's micro-batches through both stages. The two
    stages reduce over their own mirror groups, posted in *opposite* orders on the two pp ranks.
    """
    dims = init_parallel(pp=2, dp=2)
    pp, dp = dims.coord("pp"), dims.coord("dp")
    model = make_model()  # stage 0 = model[0], stage 1 = model[1]; both copies start equal
    groups = dims.stage_sync_groups([(0, 1), (1, 0)])
    syncs = {s: GradSync(model[s], groups[s].group, mode=mode, divide_by=groups[s].divide_by) for s in (0, 1)}
    opts = {s: (ZeroOptimizer(syncs[s], adamw) if mode == "zero1" else adamw(list(model[s].parameters())))
            for s in (0, 1)}
    for step in range(STEPS):
        x, y = global_batch(1 + step)
        sl = replica_rows(x, dp, 2)
        xs, ys = x[sl], y[sl]
        xc, yc = xs.chunk(2)[pp], ys.chunk(2)[pp]  # chain pp's half of this replica's micro-batches
        for xm, ym in zip(xc.chunk(2), yc.chunk(2)):
            local_loss(model(xm), ym, xs.shape[0]).backward()
        order = (0, 1) if pp == 0 else (1, 0)
        for s in order:
            syncs[s].start()
        for s in reversed(order):
            syncs[s].wait()
        for s in (0, 1):
            opts[s].step()
            opts[s].zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "group_ranks": {s: groups[s].ranks for s in groups}, "divide_by": groups[0].divide_by}


def _mirrored_both_modes(rank: int, world: int) -> dict:
    return {mode: _mirrored(rank, world, mode) for mode in ("allreduce", "zero1")}


@pytest.mark.slow  # by default: test_hybrid.py (PP2 x DP2 DualPipe = one process), test_mirrored_modes.py
def test_mirrored_stages_sum_copies_once_and_average_replicas():
    out = run_ranks(_mirrored_both_modes, 4, timeout=150)
    ref = reference(STEPS, "adamw")
    for o in out:
        for mode, r in o.items():
            assert r["group_ranks"] == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)} and r["divide_by"] == 2, mode
            for got, want in zip(r["params"], ref.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12, msg=mode)


def _errors(rank: int, world: int) -> list[str]:
    model = make_model()
    msgs = []
    for make in (lambda: GradSync(model, mode="zero3"),
                 lambda: GradSync(model, mode="fsdp"),
                 lambda: GradSync(model, divide_by=0),
                 lambda: ZeroOptimizer(GradSync(model), adamw)):
        try:
            make()
        except ValueError as exc:
            msgs.append(str(exc))
    sync = GradSync(model, mode="zero1")
    opt = ZeroOptimizer(sync, adamw)
    for call in (opt.step, sync.wait, lambda: (sync.start(), sync.start())):
        try:
            call()
        except RuntimeError as exc:
            msgs.append(str(exc))
    dist.barrier()
    return msgs


def test_bad_input_messages():
    (msgs,) = run_ranks(_errors, 1, timeout=60)
    assert msgs == [
        "unknown data-parallel mode 'zero3'; allowed: allreduce, zero1, fsdp, allreduce_bf16",
        "GradSync runs modes allreduce, zero1, allreduce_bf16, got 'fsdp': dp mode 'fsdp' reduces fully_shard stages "
        "with parallel.FSDPStageSync",
        "divide_by=0 must be >= 1",
        "ZeroOptimizer needs a GradSync in mode 'zero1', got mode 'allreduce'",
        "ZeroOptimizer.step() before the gradients were reduced: call sync.start() and sync.wait() "
        "(the stage's REDUCE op) first",
        "GradSync.wait() without a pending start()",
        "GradSync.start() called twice without wait(): one reduction per step",
    ]
