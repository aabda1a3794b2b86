"""Multi-process tests of Rewind on mt_dualpipe.Pipeline (2 gloo ranks, 1F1B): a NaN on one rank
rewinds every rank; an exception in an op (peers time out) rewinds after rebuilding the
pipeline's communication; a killed rank and a kill during a checkpoint commit are survived by
relaunching from the last complete checkpoint. Every run is compared bit-for-bit with a clean run
(no Rewind) in the same processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.resilience import KILL_EXIT_CODE, FaultInjector, FaultKind, Rewind, RewindError, fresh_group
from tests.helpers.launch import launch

DIM, BATCH, CHUNKS = 6, 8, 4


def _stage(rank: int) -> nn.Module:
    torch.manual_seed(10 + rank)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Dropout(0.1))


def _batch(rank: int, pos: int, kind: str = "1f1b") -> dict:
    g = torch.Generator().manual_seed(500 + pos)
    x0, y0, x1, y1 = (torch.randn(BATCH, DIM, generator=g) for _ in range(4))
    if kind == "dualpipe":  # chain 0 enters at rank 0 and ends at rank 1, chain 1 the other way
        return {"inputs": ((x0, x1)[rank],), "labels": ((y1, y0)[rank],)}
    return {"inputs": (x0,)} if rank == 0 else {"labels": (y0,)}


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _pipeline(rank: int, group, timeout: float, kind: str = "1f1b"):
    from mt_dualpipe import DualPipe, Pipeline

    if kind == "dualpipe":  # rank r: stage r of chain 0 and stage 1-r of chain 1 (mirrored copies)
        pipe = DualPipe((_stage(rank), _stage(1 - rank)), process_group=group, timeout=timeout)
    else:
        pipe = Pipeline([_stage(rank)], "1f1b", group, timeout=timeout)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-2)


def _plan(rank: int, plan: list[tuple]) -> FaultInjector:
    f = FaultInjector(rank=rank)
    for kind, fault_rank, step, op in plan:
        getattr(f, {"nan": "nan", "raise": "raise_in", "kill": "kill"}[kind])(fault_rank, step, op=op) \
            if kind != "kill" else f.kill(fault_rank, step, when=op)
    return f


def _params(mods) -> list[torch.Tensor]:
    return [p.detach().clone() for m in mods for p in m.parameters()]


def _clean(rank: int, steps: int, skipped: set[int], kind: str = "1f1b") -> list[torch.Tensor]:
    """The reference: a plain loop on a fresh pipeline (fresh group) over the non-skipped positions."""
    pipe, opt = _pipeline(rank, fresh_group(), 30.0, kind)
    torch.manual_seed(100 + rank)
    positions = [p for p in range(steps + len(skipped)) if p not in skipped][:steps]
    for pos in positions:
        opt.zero_grad(set_to_none=True)
        b = _batch(rank, pos, kind)
        pipe.step(*b.get("inputs", ()), num_chunks=CHUNKS, criterion=_mse, labels=b.get("labels", ()))
        if kind == "dualpipe":
            pipe.sync_mirrored_grads()
        opt.step()
    return _params(pipe.module)


def _train(rank: int, steps: int, plan: list[tuple], timeout: float, ckpt: str | None = None,
           kind: str = "1f1b", **kw) -> Rewind:
    pipe, opt = _pipeline(rank, fresh_group(), timeout, kind)
    torch.manual_seed(100 + rank)
    rw = Rewind(pipe, opt, num_chunks=CHUNKS, criterion=_mse, snapshot_every=2, faults=_plan(rank, plan),
                checkpoint_dir=ckpt, timeout=timeout + 20, **kw)
    try:
        rw.run(lambda pos: _batch(rank, pos, kind), steps)
    finally:
        rw.close()
    return rw


def _fault_worker(rank: int, world: int, out: str, scenarios: list[tuple]) -> None:
    """Run each (name, schedule, steps, plan, p2p timeout, skip policy) scenario, then its clean reference."""
    for name, kind, steps, plan, timeout, policy in scenarios:
        rw = _train(rank, steps, plan, timeout, kind=kind, skip_policy=policy)
        events = [(e.step, e.position, int(e.kind), e.ranks, e.cause, e.rewound_to, e.skipped) for e in rw.events]
        same = all(torch.equal(a, b) for a, b in zip(_params(rw.modules), _clean(rank, steps, rw.skipped, kind)))
        torch.save({"events": events, "counters": dict(rw.counters), "skipped": sorted(rw.skipped), "same": same,
                    "pipeline": type(rw.pipeline).__name__}, os.path.join(out, f"{name}{rank}.pt"))


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch runs both scenarios (process start-up dominates on a busy machine)."""
    out = tmp_path_factory.mktemp("faults")
    scenarios = [("nan", "1f1b", 7, [("nan", 1, 3, "forward")], 20.0, "skip"),
                 ("raise", "1f1b", 6, [("raise", 0, 3, "forward")], 2.0, "retry"),
                 ("dualpipe", "dualpipe", 6, [("nan", 0, 1, "backward"), ("raise", 1, 4, "forward")], 2.0, "skip")]
    assert launch(_fault_worker, 2, str(out), scenarios) == [0, 0]
    return {name: [torch.load(out / f"{name}{r}.pt") for r in range(2)] for name, *_ in scenarios}


def test_dualpipe_nan_and_exception_rewind_with_mirrored_gradients(fault_runs):
    """DualPipe: Rewind syncs the mirrored gradients only after agreement and rebuilds DualPipe itself."""
    out = fault_runs["dualpipe"]
    assert out[0]["events"] == out[1]["events"]
    (s1, _, k1, _, c1, r1, _), (s2, _, k2, ranks2, c2, r2, _) = out[0]["events"]
    assert (s1, k1, r1) == (1, FaultKind.NONFINITE_GRAD, 0) and "rank 0: a local gradient is NaN" in c1
    assert (s2, k2, r2, ranks2) == (4, FaultKind.EXCEPTION, 4, [0, 1]) and "rank 1: InjectedFault" in c2
    for o in out:
        assert o["skipped"] == [1, 5] and o["counters"]["rebuilds"] == 1 and o["pipeline"] == "DualPipe"
        assert o["same"], "parameters differ from the clean DualPipe run without batches 1 and 5"


# ----- fault, agree, rewind ----------------------------------------------------------------------
def test_nan_on_one_rank_rewinds_every_rank_and_matches_a_clean_run_without_that_batch(fault_runs):
    out = fault_runs["nan"]
    assert out[0]["events"] == out[1]["events"]  # every rank took the same decision
    (step, pos, kind, ranks, cause, rewound_to, skipped), = out[0]["events"]
    assert (step, pos, rewound_to, skipped) == (3, 3, 2, True)
    assert kind == FaultKind.NONFINITE_LOSS and 1 in ranks and "rank 1: loss is NaN or infinite" in cause
    for o in out:
        assert o["skipped"] == [3] and o["counters"]["rewinds"] == 1
        assert o["same"], "parameters differ from the clean run that skipped batch 3"


def test_exception_in_an_op_stops_the_peer_and_every_rank_rewinds(fault_runs):
    out = fault_runs["raise"]
    assert out[0]["events"] == out[1]["events"]
    (step, _, kind, ranks, cause, rewound_to, skipped), = out[0]["events"]
    assert (step, kind, ranks, rewound_to, skipped) == (3, FaultKind.EXCEPTION, [0, 1], 2, False)
    assert "rank 0: InjectedFault" in cause and "rank 1: PipelinePeerError" in cause
    for o in out:
        assert o["counters"]["rebuilds"] == 1
        assert o["same"], "parameters differ from the clean run"


# ----- kill and relaunch -------------------------------------------------------------------------
def _resume_worker(rank: int, world: int, ckpt: str, out: str, steps: int, plan: list[tuple], tag: str) -> None:
    """Train to ``steps`` with checkpoints (resuming from ``ckpt``); record how it went."""
    pipe, opt = _pipeline(rank, fresh_group(), 5.0)
    torch.manual_seed(100 + rank)
    rw = Rewind(pipe, opt, num_chunks=CHUNKS, criterion=_mse, snapshot_every=2, faults=_plan(rank, plan),
                checkpoint_dir=ckpt, timeout=25.0)
    res = {"resumed_from": rw.resumed_from, "msg": "finished"}
    try:
        rw.run(lambda pos: _batch(rank, pos), steps)
        rw.close()
        res["same"] = all(torch.equal(a, b) for a, b in zip(_params(rw.modules), _clean(rank, steps, set())))
    except RewindError as exc:
        res["msg"] = str(exc)
    res["steps"] = rw.counters["steps"]
    res["entries"] = sorted(os.listdir(ckpt))
    torch.save(res, os.path.join(out, f"{tag}{rank}.pt"))


STEPS = 10


@pytest.fixture(scope="module")
def kill_chain(tmp_path_factory) -> dict:
    """Launch 1: rank 0 dies while committing the checkpoint of step 4 (step 2's is complete).
    Launch 2: relaunch; resumes from step 2; rank 1 is killed in a forward at step 7.
    Launch 3: relaunch; resumes from the newest complete checkpoint and finishes."""
    out = tmp_path_factory.mktemp("kills")
    ckpt = str(out / "ckpt")
    chain: dict = {"ckpt": ckpt}
    chain["codes"] = [launch(_resume_worker, 2, ckpt, str(out), STEPS, [("kill", 0, 4, "commit")], "a")]
    chain["a"] = torch.load(out / "a1.pt")
    chain["codes"].append(launch(_resume_worker, 2, ckpt, str(out), STEPS, [("kill", 1, 7, "forward")], "b"))
    chain["b"] = torch.load(out / "b0.pt")
    chain["codes"].append(launch(_resume_worker, 2, ckpt, str(out), STEPS, [], "c"))
    chain["c"] = [torch.load(out / f"c{r}.pt") for r in range(2)]
    return chain


def test_kill_during_checkpoint_commit_leaves_previous_checkpoint_loadable(kill_chain):
    assert kill_chain["codes"][0] == [KILL_EXIT_CODE, 0]
    a = kill_chain["a"]  # what the surviving rank 1 saw
    assert a["msg"].startswith("step "), a["msg"]  # a clear error naming the step, not a hang
    assert "step_00000002" in a["entries"] and "step_00000004" not in a["entries"]
    assert ".tmp_step_00000004" in a["entries"]  # fully written, never committed
    b = kill_chain["b"]
    assert b["resumed_from"] == 2  # the relaunch loaded the previous complete checkpoint
    assert ".tmp_step_00000004" not in b["entries"]


def test_killed_rank_relaunch_resumes_from_checkpoint_and_matches_uninterrupted_run(kill_chain):
    assert kill_chain["codes"][1] == [0, KILL_EXIT_CODE]
    b = kill_chain["b"]  # the surviving rank 0
    assert b["msg"].startswith("step 7: the ranks could not agree"), b["msg"]
    for c in kill_chain["c"]:
        assert c["resumed_from"] in (4, 6)
        assert c["steps"] == STEPS - c["resumed_from"]  # replayed only what was lost
        assert c["same"], "the resumed run differs from the uninterrupted run"
