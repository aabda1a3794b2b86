"""Single-process tests of mt_dualpipe.resilience: snapshots, detection, fault injection, Rewind, checkpoints."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.resilience import (
    CheckpointError,
    CheckpointManager,
    FaultInjector,
    FaultKind,
    InjectedFault,
    LocalPipeline,
    LossSpikeDetector,
    Rewind,
    RewindError,
    restore_snapshot,
    take_snapshot,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
DIM, BATCH, CHUNKS = 8, 8, 2


def make_model(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Dropout(0.2)), nn.Linear(DIM, 1)]


def batch_fn(pos: int) -> dict:
    g = torch.Generator().manual_seed(1000 + pos)
    x = torch.randn(BATCH, DIM, generator=g)
    return {"inputs": (x,), "labels": (x.sum(1, keepdim=True) * 0.1,)}


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def make_rewind(tmp=None, seed: int = 0, **kw) -> tuple[Rewind, list[nn.Module]]:
    mods = make_model(seed)
    pipe = LocalPipeline(mods)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    torch.manual_seed(123)  # the dropout stream starts here in every run
    rw = Rewind(pipe, opt, num_chunks=CHUNKS, criterion=mse, checkpoint_dir=tmp, **kw)
    return rw, mods


def clean_run(positions: list[int], seed: int = 0) -> list[torch.Tensor]:
    """A plain loop (no Rewind) over exactly ``positions``."""
    mods = make_model(seed)
    pipe = LocalPipeline(mods)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    torch.manual_seed(123)
    for pos in positions:
        opt.zero_grad(set_to_none=True)
        b = batch_fn(pos)
        pipe.step(*b["inputs"], num_chunks=CHUNKS, criterion=mse, labels=b["labels"])
        opt.step()
    return [p.detach().clone() for p in pipe.parameters()]


def params(rw: Rewind) -> list[torch.Tensor]:
    return [p.detach().clone() for m in rw.modules for p in m.parameters()]


def assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# ----- snapshots --------------------------------------------------------------------------------
def test_snapshot_restores_modules_optimizer_and_rng_bit_exactly():
    rw, mods = make_rewind(snapshot_every=100)
    for _ in range(3):
        rw.step(batch_fn)
    snap = take_snapshot(3, 3, mods, rw.optimizer)
    before = params(rw)
    draw = torch.rand(4)
    for _ in range(2):
        rw.step(batch_fn)
    assert not all(torch.equal(x, y) for x, y in zip(before, params(rw)))
    restore_snapshot(snap, mods, rw.optimizer)
    assert_bit_equal(before, params(rw))
    assert torch.equal(torch.rand(4), draw)  # the RNG is back too
    # the optimizer state is a private copy: stepping must not alter the snapshot
    exp_avg = next(iter(snap.optimizer["state"].values()))["exp_avg"].clone()
    rw.step(batch_fn)
    assert torch.equal(next(iter(snap.optimizer["state"].values()))["exp_avg"], exp_avg)


def test_snapshot_needs_matching_module_count():
    mods = make_model()
    snap = take_snapshot(0, 0, mods, None)
    with pytest.raises(ValueError, match="holds 2 modules but 1 were given"):
        restore_snapshot(snap, mods[:1], None)


# ----- detection --------------------------------------------------------------------------------
def test_loss_spike_zscore():
    det = LossSpikeDetector(zscore=3.0, window=5, min_history=5)
    for v in (1.0, 1.1, 0.9, 1.0, 1.0):
        assert det.is_spike(v)[0] is False
        det.push(v)
    # mean 1.0, sample std sqrt(0.02/4) = 0.0707
    spike, z = det.is_spike(1.5)
    assert spike and z == pytest.approx(0.5 / math.sqrt(0.005))
    assert det.is_spike(1.2)[0] is False  # z = 2.83
    assert det.is_spike(0.0)[0] is False  # only upward spikes count
    det.push(1.0)
    assert len(det.history) == 5  # the window slides


def test_spike_detector_rejects_bad_settings():
    with pytest.raises(ValueError, match="spike_zscore must be positive"):
        LossSpikeDetector(zscore=0)
    with pytest.raises(ValueError, match="window must be an integer of at least 2"):
        LossSpikeDetector(window=1)


# ----- Rewind -----------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_nan_fault_rewinds_and_matches_a_clean_run_that_skips_the_batch(op):
    k, steps = 5, 9
    faults = FaultInjector(rank=0)
    faults.nan(rank=0, step=k, module=0, op=op)
    rw, _ = make_rewind(snapshot_every=3, faults=faults)
    results = rw.run(batch_fn, steps)
    bad = [r for r in results if not r.ok]
    assert len(bad) == 1 and bad[0].step == k and bad[0].position == k
    assert bad[0].fault.kind in (FaultKind.NONFINITE_LOSS, FaultKind.NONFINITE_GRAD)
    assert bad[0].fault.rewound_to == 3 and bad[0].fault.skipped
    assert rw.counters["rewinds"] == 1 and rw.counters["skipped_batches"] == 1
    assert rw.skipped == {k}
    # 3 replayed steps (3, 4 then 6) after the rewind: 9 successful + 2 replays
    assert rw.counters["steps"] == steps + 2
    positions = [p for p in range(steps + 1) if p != k]
    assert_bit_equal(params(rw), clean_run(positions))


def test_exception_in_an_op_rewinds_and_retries_the_batch():
    faults = FaultInjector(rank=0)
    faults.raise_in(rank=0, step=4, op="backward", module=1)
    rw, _ = make_rewind(snapshot_every=2, skip_policy="retry", faults=faults)
    results = rw.run(batch_fn, 6)
    bad = [r for r in results if not r.ok]
    assert [b.fault.kind for b in bad] == [FaultKind.EXCEPTION]
    assert "InjectedFault" in bad[0].fault.cause and "rank 0" in bad[0].fault.cause
    assert not bad[0].fault.skipped and rw.skipped == set()
    assert_bit_equal(params(rw), clean_run(list(range(6))))  # a transient fault: the retry is the clean step


def test_consecutive_faults_stop_with_an_error_naming_step_and_cause():
    faults = FaultInjector(rank=0)
    for _ in range(3):
        faults.nan(rank=0, step=2)
    rw, _ = make_rewind(snapshot_every=1, max_retries=2, skip_policy="retry", faults=faults)
    with pytest.raises(RewindError, match=r"step 2 \(data position 2\): non-finite loss .*3 consecutive faults "
                                          r"\(max_retries=2\)"):
        rw.run(batch_fn, 5)
    assert rw.counters["rewinds"] == 2 and rw.counters["faults"] == 3


def test_repeated_faults_rewind_further_back():
    faults = FaultInjector(rank=0)
    faults.nan(rank=0, step=4)
    faults.nan(rank=0, step=4)
    rw, _ = make_rewind(snapshot_every=2, keep=3, skip_policy="retry", faults=faults)
    rw.run(batch_fn, 5)
    assert [e.rewound_to for e in rw.events] == [4, 2]
    assert_bit_equal(params(rw), clean_run(list(range(5))))


def test_loss_spike_is_a_fault():
    def spiky(pos: int) -> dict:
        b = batch_fn(pos)
        if pos == 12:
            b["labels"] = (b["labels"][0] + 100.0,)
        return b

    rw, _ = make_rewind(snapshot_every=4, spike_zscore=4.0, window=10)
    results = rw.run(spiky, 14)
    bad = [r for r in results if not r.ok]
    assert [(b.step, b.fault.kind) for b in bad] == [(12, FaultKind.LOSS_SPIKE)]
    assert "z-score" in bad[0].fault.cause
    assert rw.skipped == {12}


def test_nan_input_is_a_fault_named_as_such():
    def poisoned(pos: int) -> dict:
        b = batch_fn(pos)
        if pos == 1:
            b["inputs"][0][0, 0] = float("nan")
        return b

    rw, _ = make_rewind(snapshot_every=1)
    results = rw.run(poisoned, 3)
    bad = [r for r in results if not r.ok]
    assert len(bad) == 1 and bad[0].fault.kind == FaultKind.NONFINITE_INPUT
    assert "input tensor 0 (shape (8, 8), float32) has 1 non-finite value" in bad[0].fault.cause


def test_rewind_rejects_bad_settings():
    mods = make_model()
    pipe = LocalPipeline(mods)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="skip_policy must be one of skip, retry, got 'drop'"):
        Rewind(pipe, opt, skip_policy="drop")
    with pytest.raises(ValueError, match="snapshot_every must be an integer of at least 1, got 0"):
        Rewind(pipe, opt, snapshot_every=0)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive multiple of snapshot_every=4"):
        Rewind(pipe, opt, snapshot_every=4, checkpoint_every=6)
    with pytest.raises(ValueError, match="pass modules="):
        Rewind(object(), opt)


def test_injector_rejects_bad_plans():
    f = FaultInjector()
    with pytest.raises(ValueError, match="op for a nan fault must be one of forward, backward, got 'commit'"):
        f.nan(rank=0, step=1, op="commit")
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        f.kill(rank=0, step=-1)
    f.raise_in(rank=0, step=0, module=5)
    with pytest.raises(ValueError, match="targets local module 5 but rank 0 has 2"):
        f.attach(make_model())


def test_injected_exception_fires_once_on_its_rank_only():
    mods = make_model()
    f = FaultInjector(rank=0)
    f.raise_in(rank=0, step=1)
    f.raise_in(rank=1, step=1)  # another rank's plan: ignored here
    f.attach(mods)
    x = torch.randn(2, DIM)
    f.begin_step(0)
    mods[0](x)
    f.begin_step(1)
    with pytest.raises(InjectedFault, match="rank 0, step 1, forward of local module 0"):
        mods[0](x)
    mods[0](x)  # fired once


# ----- checkpoints (single process) -------------------------------------------------------------
def test_checkpoint_resume_is_bit_exact(tmp_path):
    rw, _ = make_rewind(tmp_path, snapshot_every=2, keep_checkpoints=2)
    rw.run(batch_fn, 5)
    rw.close()
    assert rw.checkpoint_mode == "dcp.async_save"
    assert rw.checkpoints.complete_steps() == [2, 4]
    # a fresh process would build the same objects from scratch (different init) and resume
    rw2, _ = make_rewind(tmp_path, seed=99, snapshot_every=2)
    assert rw2.step_index == 4 and rw2.position == 4 and rw2.counters["resumed"] == 1
    rw2.run(batch_fn, 8)
    rw2.close()
    assert_bit_equal(params(rw2), clean_run(list(range(8))))
    assert rw2.checkpoints.complete_steps() == [6, 8]  # keep_checkpoints=2 pruned the rest


def test_interrupted_commit_leaves_previous_checkpoint_loadable(tmp_path):
    rw, _ = make_rewind(tmp_path, snapshot_every=2)
    rw.run(batch_fn, 4)
    rw.close()
    assert rw.checkpoints.complete_steps() == [2, 4]

    def crash(step: int) -> None:
        raise KeyboardInterrupt("killed mid-write")

    rw.checkpoints.before_commit = crash  # runs in the commit thread, right before the rename
    rw.run(batch_fn, 6)
    with pytest.raises(CheckpointError, match=r"committing the checkpoint of step 6 \(.*\.tmp_step_00000006\) "
                                              "failed: killed mid-write"):
        rw.close()
    assert os.path.isdir(tmp_path / ".tmp_step_00000006")
    mgr = CheckpointManager(tmp_path)  # a restart: cleans the partial write, finds the last complete one
    assert not os.path.exists(tmp_path / ".tmp_step_00000006")
    assert mgr.latest() == 4
    snap = mgr.load(4)
    assert snap.step == 4 and snap.position == 4
    assert_bit_equal([t for m in snap.modules for t in m.values()], clean_run(list(range(4))))


@pytest.mark.parametrize("use_async", [True, False])
def test_checkpoint_commits_as_soon_as_written_without_a_poll(tmp_path, use_async):
    """The commit does not wait for the training thread's next step: it happens once the write ends."""
    mods = make_model()
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    mgr = CheckpointManager(tmp_path, use_async=use_async)
    mgr.save(take_snapshot(2, 2, mods, opt))
    deadline = time.monotonic() + 60
    while not mgr.complete_steps() and time.monotonic() < deadline:  # no poll(), no wait()
        time.sleep(0.05)
    assert mgr.complete_steps() == [2] and not os.path.exists(tmp_path / ".tmp_step_00000002")
    assert mgr.poll() == 2 and mgr.committed == [2] and mgr.poll() is None


def test_thread_fallback_checkpoint_roundtrip(tmp_path):
    """The background-thread writer (for a torch without async_save) follows the same commit protocol."""
    mods = make_model()
    opt = torch.optim.Adam([p for m in mods for p in m.parameters()], lr=1e-2)
    mgr = CheckpointManager(tmp_path, keep=1, use_async=False)
    assert mgr.mode == "thread+dcp.save"
    snap = take_snapshot(3, 7, mods, opt, extra={"skipped": [5]})
    mgr.save(snap)
    assert mgr.wait() == 3 and mgr.latest() == 3
    back = mgr.load(3)
    assert (back.step, back.position, back.extra) == (3, 7, {"skipped": [5]})
    assert_bit_equal([t for m in back.modules for t in m.values()], [t for m in snap.modules for t in m.values()])
    assert torch.equal(back.rng["torch"], snap.rng["torch"]) and back.rng["python"] == snap.rng["python"]
    mgr.save(take_snapshot(5, 9, mods, opt))
    mgr.wait()
    assert mgr.complete_steps() == [5]  # keep=1


def test_grad_norm_and_agreement_verdict():
    from mt_dualpipe.resilience.agree import Agreement, LocalReport
    from mt_dualpipe.resilience.detect import grad_sq_norm

    mods = make_model()
    out = mods[1](mods[0](torch.randn(4, DIM)))
    out.sum().backward()
    ref = sum(float(p.grad.double().pow(2).sum()) for m in mods for p in m.parameters())
    assert grad_sq_norm(mods) == pytest.approx(ref, rel=1e-6)
    single = Agreement(None, timeout=1.0)  # one process: the verdict is the local report
    v = single.decide(0, LocalReport(loss_sum=3.0, loss_count=2, grad_sq=ref))
    assert v.ok and v.loss == 1.5 and v.grad_norm == pytest.approx(math.sqrt(ref))
    report = LocalReport()
    report.fault(FaultKind.NONFINITE_GRAD, "grad")
    report.fault(FaultKind.NONFINITE_LOSS, "loss")
    report.fault(FaultKind.LOSS_SPIKE, "spike")  # less severe: ignored
    v = single.decide(4, report)
    assert v.kind == FaultKind.NONFINITE_LOSS and v.describe() == "non-finite loss (rank 0: loss)"


def test_snapshot_reuses_a_discarded_snapshots_buffers():
    rw, mods = make_rewind(snapshot_every=100)
    rw.step(batch_fn)  # the optimizer has state from here on: the sizes stay the same
    old = take_snapshot(1, 1, mods, rw.optimizer)
    rw.step(batch_fn)
    storage = {k: b.data_ptr() for k, b in old.buffers.items()}
    new = take_snapshot(2, 2, mods, rw.optimizer, reuse=old)
    assert {k: b.data_ptr() for k, b in new.buffers.items()} == storage  # written in place
    assert_bit_equal([t for m in new.modules for t in m.values()], params(rw))
    assert new.nbytes() == sum(b.numel() * b.element_size() for b in new.buffers.values()) > 0
