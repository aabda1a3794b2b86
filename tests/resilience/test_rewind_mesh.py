"""Rewind on a PP2 x DP2 mesh (4 gloo ranks, 1F1B): a NaN on one data-parallel replica rewinds every
replica, in allreduce mode and in zero1 mode (sharded optimizer state in the snapshots, gradients
only in the reduced shards), in fsdp mode and on DualPipe's mirrored stages; in zero1 mode an
exception on one replica also rewinds every replica (the other replica's reduction wait is bounded,
every pipeline line and data-parallel group is rebuilt, the ZeRO-1 optimizer keeps working). Each
run ends with exactly the parameters of a clean run that never read the faulty batches, on every
rank. Rewind refuses a group narrower than the mesh."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.resilience import FaultInjector, FaultKind, Rewind
from mt_dualpipe.runtime import DualPipe, Pipeline
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import adamw, global_batch, local_loss, make_model

DP, STEPS = 2, 5
NAN_RANK, NAN_STEP = 3, 2  # pp 1, dp 1: the last stage of the second replica
RAISE_RANK, RAISE_STEP = 1, 3  # pp 0, dp 1: the first stage of the second replica (reads position 4)
TIMEOUT = 8.0  # the pipeline's point-to-point timeout, and the bound of each data-parallel wait


def _pipe(mode: str):
    """``mode``: a dp_mode on 1F1B, or "dualpipe/<dp_mode>" (rank r holds stage r and, mirrored, 1 - r)."""
    kind, _, dp_mode = mode.rpartition("/")
    dims = init_parallel(pp=2, dp=DP)
    pp = dims.coord("pp")
    model = make_model(blocks=2)
    if kind == "dualpipe":
        pipe = DualPipe((model[pp], model[1 - pp]), mesh=dims, dp_mode=dp_mode, timeout=TIMEOUT)
        return dims, pipe, pipe.build_optimizer(adamw)
    stage = model[pp]
    if dp_mode == "fsdp":
        stage = fully_shard(stage, mesh=dims.submesh("dp"))
    pipe = Pipeline([stage], "1f1b", mesh=dims, dp_mode=dp_mode, timeout=TIMEOUT)
    return dims, pipe, pipe.build_optimizer(adamw)


def _batch(pp: int, pos: int, mode: str) -> dict:
    x, y = global_batch(1 + pos)
    if mode.startswith("dualpipe"):  # each end feeds half of the global batch and holds the other half's labels
        return {"inputs": (x.chunk(2)[pp],), "labels": (y.chunk(2)[1 - pp],)}
    return {"inputs": (x,)} if pp == 0 else {"labels": (y,)}


def _chunks(mode: str) -> int:
    return 4 if mode.startswith("dualpipe") else 2  # DualPipe: at least 2 x P micro-batches


def _criterion(out, y):
    return local_loss(out, y, global_batch(1)[0].shape[0] // DP)


def _clean(mode: str, skipped: set[int]) -> list[torch.Tensor]:
    dims, pipe, opt = _pipe(mode)
    positions = [p for p in range(STEPS + len(skipped)) if p not in skipped][:STEPS]
    for pos in positions:
        opt.zero_grad()
        b = _batch(dims.coord("pp"), pos, mode)
        pipe.step(*b.get("inputs", ()), num_chunks=_chunks(mode), criterion=_criterion, labels=b.get("labels", ()))
        opt.step()
    return _full(pipe)


def _full(pipe) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in pipe.parameters()]


def _worker(rank: int, world: int, mode: str) -> dict:
    dims, pipe, opt = _pipe(mode)
    with pytest.raises(ValueError, match="every data-parallel replica must agree"):
        Rewind(pipe, opt, group=dims.group("pp"))
    faults = FaultInjector(rank=rank)
    faults.nan(rank=NAN_RANK, step=NAN_STEP, op="forward")
    if mode == "zero1":
        faults.raise_in(rank=RAISE_RANK, step=RAISE_STEP, op="forward")
    rw = Rewind(pipe, opt, num_chunks=_chunks(mode), criterion=_criterion, snapshot_every=2, faults=faults)
    rw.run(lambda pos: _batch(dims.coord("pp"), pos, mode), STEPS)
    mine = _full(rw.pipeline)
    clean = _clean(mode, rw.skipped)
    return {"events": [(e.step, e.position, int(e.kind), e.ranks, e.rewound_to) for e in rw.events],
            "skipped": sorted(rw.skipped), "same": all(torch.equal(a, b) for a, b in zip(mine, clean)),
            "params": mine, "pp": dims.coord("pp"), "state": opt.state_bytes(),
            "rebuilds": rw.counters["rebuilds"], "pipeline": type(rw.pipeline).__name__}


@pytest.mark.parametrize("mode", ["zero1"] + [pytest.param(m, marks=pytest.mark.slow)  # zero1: the harder case
                                            for m in ("allreduce", "fsdp", "dualpipe/zero1")])
def test_nan_on_one_replica_rewinds_every_replica(mode: str) -> None:
    out = run_ranks(_worker, 4, mode, timeout=240)
    raises = mode == "zero1"
    for o in out:
        assert o["events"] == out[0]["events"]
        assert o["skipped"] == ([NAN_STEP, 4] if raises else [NAN_STEP]) and o["same"], (o["skipped"], o["same"])
        assert o["rebuilds"] == int(raises) and o["pipeline"] == ("DualPipe" if "dualpipe" in mode else "Pipeline")
    step, pos, kind, ranks, rewound_to = out[0]["events"][0]
    assert (step, pos, rewound_to) == (NAN_STEP, NAN_STEP, 2) and NAN_RANK in ranks
    assert kind >= FaultKind.NONFINITE_GRAD
    if raises:  # every rank raised: the faulty one, its pipeline peer (stopped by it), the other replica (bounded wait)
        assert out[0]["events"][1] == (RAISE_STEP, 4, int(FaultKind.EXCEPTION), [0, 1, 2, 3], 2)
    for a, b in zip(out[0]["params"], out[1]["params"]):  # the two replicas of pipeline rank 0 stayed equal
        assert torch.equal(a, b)
    if mode.endswith("zero1"):  # the snapshots held sharded state: at most half of allreduce's per rank
        assert all(o["state"] < 0.6 * 2 * 8 * sum(p.numel() for p in o["params"]) for o in out)
    if mode == "fsdp":  # the replicas' FSDP shards make up the same full parameters
        for a, b in zip(out[2]["params"], out[3]["params"]):
            assert torch.equal(a, b)
