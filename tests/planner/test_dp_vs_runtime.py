"""The planner's ZeRO-1 optimizer-state estimate against what the runtime holds (PP2 x DP2, 4 gloo ranks).

The planner's memory model (``estimate.memory_breakdown``) counts, per rank, its stages' parameters
x the optimizer's bytes per parameter (two FP32 Adam moments for ``dtype="fp32"``), divided by dp
with ZeRO-1. The runtime's ``PipelineOptimizer.state_bytes()`` after a real AdamW step on a tiny
FP32 model must agree within 3 %: what the planner leaves out is AdamW's per-parameter step
counter (4 bytes per parameter tensor) and ZeRO's dim-0 padding (none here: every dim 0 is even).
The exposed-sync side (simulated ``dp_exposed`` against the measured wait) is a benchmark row in
``benchmarks/hybrid_step.py``: timings are not asserted.
"""

from __future__ import annotations

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.planner.estimate import GB, Strategy, memory_breakdown
from mt_dualpipe.planner.model import Item
from mt_dualpipe.runtime import Pipeline
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import GLOBAL_ROWS, adamw, global_batch, local_loss, make_model

DP = 2
TOLERANCE = 0.03


def _worker(rank: int, world: int) -> dict:
    out = {}
    for mode in ("allreduce", "zero1"):
        dims = init_parallel(pp=2, dp=DP)
        pp = dims.coord("pp")
        stage = make_model(blocks=2).float()[pp]
        pipe = Pipeline([stage], "1f1b", mesh=dims, dp_mode=mode)
        opt = pipe.build_optimizer(adamw)
        x, y = (t.float() for t in global_batch(1))
        pipe.step(*((x,) if pp == 0 else ()), num_chunks=2, labels=(y,) if pp == 1 else (),
                  criterion=lambda o, t: local_loss(o, t, GLOBAL_ROWS // DP))
        opt.step()
        out[mode] = opt.state_bytes()
        out["params"] = sum(p.numel() for p in stage.parameters())
        out["tensors"] = len(list(stage.parameters()))
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
        for zero, mode in ((0, "allreduce"), (1, "zero1")):
            planned, measured = _planned(params, o["pp"], zero), o[mode]
            assert abs(measured - planned) / planned < TOLERANCE, (mode, o["pp"], measured, planned)
            assert abs(measured - planned - 4 * o["tensors"]) < 1e-6  # exactly the step counters (no padding here)
        assert abs(o["zero1"] - 4 * o["tensors"] - (o["allreduce"] - 4 * o["tensors"]) / DP) < 1e-6
