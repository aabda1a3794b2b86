"""The planner's optimizer-state estimate against what the runtime holds (PP2 x DP2, 4 gloo ranks).

The planner's memory model (``estimate.memory_breakdown``) counts, per rank, its stages' parameters
x the optimizer's bytes per parameter (two FP32 Adam moments for ``dtype="fp32"``), divided by dp
with ZeRO-1 and FSDP. What the runtime's optimizer holds after a real AdamW step on a tiny FP32
model (this rank's local tensors: FSDP's state is DTensor shards) must agree within 3 %: what the
planner leaves out is AdamW's per-parameter step counter (4 bytes per parameter tensor) and the
dim-0 padding of a shard (none here: every dim 0 is even).
The exposed-sync side (simulated ``dp_exposed`` against the measured wait) is a benchmark row in
``benchmarks/hybrid_step.py``: timings are not asserted.
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.parallel.modes import DP_MODES
from mt_dualpipe.planner.estimate import GB, Strategy, memory_breakdown
from mt_dualpipe.planner.model import Item
from mt_dualpipe.runtime import Pipeline
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import GLOBAL_ROWS, adamw, global_batch, local_loss, make_model

DP = 2
TOLERANCE = 0.03


MODES = ((0, "allreduce"), (1, "zero1"), (3, "fsdp"))


def _local_state_bytes(opt) -> int:
    """Bytes of optimizer state this rank holds, as the library counts them (a DTensor: its local shard)."""
    from mt_dualpipe.parallel.zero import optimizer_state_bytes

    return sum(optimizer_state_bytes(o) for o in opt.optimizers)


def _worker(rank: int, world: int) -> dict:
    out = {}
    for _, mode in MODES:
        dims = init_parallel(pp=2, dp=DP)
        pp = dims.coord("pp")
        stage = make_model(blocks=2).float()[pp]
        out["params"] = sum(p.numel() for p in stage.parameters())
        out["tensors"] = len(list(stage.parameters()))
        if DP_MODES[mode].needs_fully_shard:
            stage = fully_shard(stage, mesh=dims.submesh("dp"))
        pipe = Pipeline([stage], "1f1b", mesh=dims, dp_mode=mode)
        opt = pipe.build_optimizer(adamw)
        x, y = (t.float() for t in global_batch(1))
        pipe.step(*((x,) if pp == 0 else ()), num_chunks=2, labels=(y,) if pp == 1 else (),
                  criterion=lambda o, t: local_loss(o, t, GLOBAL_ROWS // DP))
        opt.step()
        out[mode] = _local_state_bytes(opt)
        out["pp"] = pp
    return out


def _planned(params: list[int], pp: int, zero: int) -> float:
    strategy = Strategy(pp=2, schedule="1f1b", num_microbatches=2, dp=DP, zero=zero, dtype="fp32")
    stages = [[Item(f"stage{s}", float(n), 0.0, 0.0, 0.0, 0.0)] for s, n in enumerate(params)]
    return memory_breakdown(strategy, stages, [pp], 0.0)["optimizer"] * GB


def test_optimizer_state_bytes_match_the_planner() -> None:
    out = run_ranks(_worker, 4, timeout=180)
    params = [next(o["params"] for o in out if o["pp"] == s) for s in range(2)]
    for o in out:
        for zero, mode in MODES:
            planned, measured = _planned(params, o["pp"], zero), o[mode]
            assert abs(measured - planned) / planned < TOLERANCE, (mode, o["pp"], measured, planned)
            assert abs(measured - planned - 4 * o["tensors"]) < 1e-6  # exactly the step counters (no padding here)
        assert abs(o["zero1"] - 4 * o["tensors"] - (o["allreduce"] - 4 * o["tensors"]) / DP) < 1e-6
        assert o["fsdp"] == o["zero1"]  # FSDP shards the optimizer state as ZeRO-1 does
