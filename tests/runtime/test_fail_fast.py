"""A failure on one rank stops every rank of the pipeline within milliseconds, and the next step works.

One rank raises in a stage's F, B or W (``tests/helpers/faulty.py``), or while its step splits its
inputs or labels; every rank must raise a ``PipelineError`` naming the failing rank, the op and the
cause, long before the pipeline's 60 s timeout, and the same pipeline's next step must give the
gradients of a clean step. Two launches (2 and 4 gloo ranks) run every case one after the other on
one process group; each case checks a clean step, the failing one and the one after. ``Rewind``
recovers such a step with the same pipeline (``rebuild=None``), matching a clean run that skipped
the batch.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.faulty import Faulty, Unsplittable

DIM = 6
TIMEOUT = 60.0  # the pipeline's point-to-point timeout: what a stalled rank used to wait
# A peer blocked on the failing rank wakes when that rank closes the pipeline's link (a millisecond),
# a rank blocked on that peer when the peer closes its own (one more hop each, P-1 at most), a rank
# still computing at its next wait; each then reads the board (P store reads). Measured: 10-70 ms on
# two busy cores (benchmarks/fail_fast.py). 10 s leaves room for a loaded machine scheduling 4
# processes on 2 cores and is still 6x below the timeout the ranks waited before.
BOUND = 10.0


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _pipeline(sched: str, rank: int, world: int):
    from mt_dualpipe import DualPipeV, Pipeline

    stages = [rank] if sched == "1f1b" else [rank, 2 * world - 1 - rank]
    mods = []
    for s in stages:
        torch.manual_seed(s)
        mods.append(Faulty(DIM))
    pipe = DualPipeV(tuple(mods), timeout=TIMEOUT) if sched == "dualpipev" else Pipeline(mods, sched, timeout=TIMEOUT)
    pipe.fuse_backward = False  # the cases fail at the schedule's W ops, so every W runs as one
    return pipe, mods


def _case(rank: int, world: int, case: tuple) -> dict:
    """A clean step, the step that fails on rank ``frank``, a clean step again: what each rank saw."""
    from mt_dualpipe.runtime import PipelineError

    sched, frank, op, module, n, chunks = case
    pipe, mods = _pipeline(sched, rank, world)
    torch.manual_seed(100)
    x, y = torch.randn(2 * chunks, DIM), torch.randn(2 * chunks, DIM)

    def step(inputs=x, labels=y):
        return pipe.step(*((inputs,) if pipe.needs_inputs else ()), num_chunks=chunks, criterion=_mse,
                         labels=(labels,) if pipe.needs_labels else ())

    loss0, _ = step()
    grads0 = [p.grad.clone() for p in pipe.parameters()]
    pipe.zero_grad()
    bad_x, bad_y, raised_at = x, y, None
    if rank == frank and op == "inputs":
        bad_x = x.as_subclass(Unsplittable)
    elif rank == frank and op == "labels":
        bad_y = y.as_subclass(Unsplittable)
    elif rank == frank:
        mods[module].arm(op, n)
    out = {"error": None}
    start = time.time()
    try:
        step(bad_x, bad_y)
    except PipelineError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["caught_at"] = time.time()
    if rank == frank:
        raised_at = start if op in ("inputs", "labels") else mods[module].raised_at
    out["raised_at"] = raised_at
    pipe.zero_grad()
    loss1, _ = step()
    out["same"] = all(torch.equal(a, p.grad) for a, p in zip(grads0, pipe.parameters())) and (
        loss0 is None or torch.equal(loss0, loss1))
    return out


def _rewind(rank: int, world: int, faulty: bool) -> dict:
    """Five steps under Rewind, rank 1's backward raising at step 2 (``faulty``) or batch 2 skipped."""
    from mt_dualpipe.resilience import FaultInjector, Rewind

    pipe, _ = _pipeline("1f1b", rank, world)
    faults = FaultInjector(rank=rank)
    if faulty:
        faults.raise_in(rank=1, step=2, op="backward")
    rw = Rewind(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), num_chunks=2, criterion=_mse, snapshot_every=1,
                rebuild=None, faults=faults, skip=() if faulty else (2,))

    def batch(pos):
        g = torch.Generator().manual_seed(pos)
        x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
        return {"inputs": (x,) if pipe.needs_inputs else (), "labels": (y,) if pipe.needs_labels else ()}

    start = time.time()
    rw.run(batch, 4)
    return {"seconds": time.time() - start, "events": [(e.step, int(e.kind), e.ranks, e.cause) for e in rw.events],
            "skipped": sorted(rw.skipped), "pipeline_kept": rw.pipeline is pipe,
            "params": [p.detach().clone() for p in pipe.parameters()]}


def _worker(rank: int, world: int, cases: dict, rewind: bool) -> dict:
    out = {name: _case(rank, world, case) for name, case in cases.items()}
    if rewind:
        out["rewind"] = (_rewind(rank, world, True), _rewind(rank, world, False))
    return out


# (schedule, failing rank, op, its local module, the n-th call of the op that raises, num_chunks)
CASES_2 = {
    "1f1b F on rank 0": ("1f1b", 0, "F", 0, 1, 4),
    "1f1b BW on the last rank": ("1f1b", 1, "B", 0, 0, 4),
    "zbv last W of rank 0": ("zbv", 0, "W", 0, 3, 4),  # rank 1 may be done with every op: the end agreement
    "zbv B on rank 1": ("zbv", 1, "B", 0, 1, 4),
    "dualpipev F on rank 1": ("dualpipev", 1, "F", 1, 2, 4),
    "dualpipev last W on rank 0": ("dualpipev", 0, "W", 0, 3, 4),
    "splitting the inputs on rank 0": ("1f1b", 0, "inputs", 0, 0, 4),
    "splitting the labels on rank 1": ("1f1b", 1, "labels", 0, 0, 4),
}
CASES_4 = {
    "1f1b F on rank 2": ("1f1b", 2, "F", 0, 1, 4),
    "zbv last W of rank 3": ("zbv", 3, "W", 1, 7, 8),
    "dualpipev B on rank 1": ("dualpipev", 1, "B", 1, 2, 8),
    "splitting the labels on rank 3": ("1f1b", 3, "labels", 0, 0, 4),
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_worker, 2, CASES_2, True, timeout=120)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_worker, 4, CASES_4, False, timeout=120)


def _check(results: list[dict], name: str, case: tuple) -> None:
    sched, frank, op, module, n, _ = case
    world = len(results)
    if op in ("inputs", "labels"):
        origins = [f"rank {frank} while preparing the step: ValueError: this batch refuses to be split"]
    else:  # a B fails in a BW where the schedule runs both at once (1F1B, DualPipeV's last micro-batches)
        stage = frank if module == 0 else 2 * world - 1 - frank
        origins = [f"rank {frank} {o}(chain 0, stage {stage}, mb " for o in ((op, "BW") if op == "B" else (op,))]
    kind, msg = results[frank][name]["error"]
    assert kind == "PipelineError" and msg.startswith(tuple(origins)), (name, msg)
    if op not in ("inputs", "labels"):
        assert msg.endswith(f"in Faulty: InjectedError: injected {op} failure"), (name, msg)
    for r in range(world):
        if r != frank:
            kind, peer = results[r][name]["error"]
            assert kind == "PipelinePeerError", (name, r, kind, peer)
            assert peer == f"rank {r}: rank {frank} failed, so every rank of the pipeline stopped this step: {msg}"
    raised = results[frank][name]["raised_at"]
    assert raised is not None, name
    slowest = max(res[name]["caught_at"] for res in results) - raised
    assert slowest < BOUND, f"{name}: the last rank stopped {slowest:.2f}s after the raise"
    assert all(res[name]["same"] for res in results), f"{name}: the next step's gradients differ from a clean step"


@pytest.mark.parametrize("name", CASES_2)
def test_two_ranks_stop_together_and_step_again(two_ranks, name):
    _check(two_ranks, name, CASES_2[name])


@pytest.mark.parametrize("name", CASES_4)
def test_four_ranks_stop_together_and_step_again(four_ranks, name):
    _check(four_ranks, name, CASES_4[name])


def test_rewind_recovers_the_failed_step_with_the_same_pipeline(two_ranks):
    for r, res in enumerate(two_ranks):
        faulty, clean = res["rewind"]
        (step, kind, ranks, cause), = faulty["events"]
        assert (step, ranks, faulty["skipped"]) == (2, [0, 1], [2]) and faulty["pipeline_kept"]
        assert "rank 1: InjectedFault" in cause and "rank 0: PipelinePeerError" in cause, cause
        assert faulty["seconds"] < BOUND, f"rank {r}: four steps and a rewind took {faulty['seconds']:.1f}s"
        assert all(torch.equal(a, b) for a, b in zip(faulty["params"], clean["params"])), \
            f"rank {r}: the parameters differ from a clean run that skipped batch 2"
