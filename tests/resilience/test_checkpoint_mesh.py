"""Rewind's asynchronous checkpoints on a mesh reshard: written at PP2 x DP2 with ZeRO-1 (sharded
optimizer state saved by DCP as DTensors), resumed at PP2 x DP1 (plain AdamW), and the reverse.
After each resume the parameters and the full optimizer state equal the writer's, and training
continues on the single-process reference's trajectory."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.resilience import Rewind
from mt_dualpipe.runtime import Pipeline
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import GLOBAL_ROWS, adamw, global_batch, local_loss, make_model, reference

CHUNKS = 2


def _full_state(opt) -> dict:
    """Every optimizer state tensor by parameter name, full (DTensor shards gathered)."""
    out = {}
    for name, per in opt.state_dict()["state"].items():
        for k, v in per.items():
            out[f"{name}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _worker(rank: int, world: int, ckpt: str, dp: int, mode: str, steps: int) -> dict:
    dims = init_parallel(pp=2, dp=dp)
    pp = dims.coord("pp")
    pipe = Pipeline([make_model(blocks=2)[pp]], "1f1b", mesh=dims, dp_mode=mode, timeout=60)
    opt = pipe.build_optimizer(adamw)
    rows = GLOBAL_ROWS // dp

    def batch(pos: int) -> dict:
        x, y = global_batch(1 + pos)
        return {"inputs": (x,)} if pp == 0 else {"labels": (y,)}

    rw = Rewind(pipe, opt, num_chunks=CHUNKS, criterion=lambda o, y: local_loss(o, y, rows), snapshot_every=2,
                checkpoint_dir=ckpt)
    resumed = {"from": rw.resumed_from, "params": [p.detach().clone() for p in pipe.parameters()],
               "state": _full_state(opt) if rw.resumed_from is not None else None}
    rw.run(batch, steps)
    rw.close()
    ref = reference(steps, "adamw")[pp]
    diff = max((a - b).abs().max().item() for a, b in zip(pipe.parameters(), ref.parameters()))
    return {"resumed": resumed, "diff": diff, "params": [p.detach().clone() for p in pipe.parameters()],
            "state": _full_state(opt), "pp": pp}


def _check_resume(before: list[dict], after: list[dict], step: int) -> None:
    by_pp = {o["pp"]: o for o in before}
    for o in after:
        w = by_pp[o["pp"]]
        assert o["resumed"]["from"] == step
        assert all(torch.equal(a, b) for a, b in zip(o["resumed"]["params"], w["params"]))
        assert o["resumed"]["state"].keys() == w["state"].keys()
        assert all(torch.equal(o["resumed"]["state"][k], w["state"][k]) for k in w["state"])


@pytest.fixture(scope="module")
def dp2_then_dp1(tmp_path_factory) -> tuple[str, list[dict], list[dict]]:
    """PP2 x DP2 with ZeRO-1 checkpoints at step 2; PP2 x DP1 (plain AdamW) resumes there and checkpoints at 4."""
    ckpt = str(tmp_path_factory.mktemp("mesh") / "ckpt")
    a = run_ranks(_worker, 4, ckpt, 2, "zero1", 2, timeout=240)
    b = run_ranks(_worker, 2, ckpt, 1, "allreduce", 4, timeout=240)
    return ckpt, a, b


def test_zero1_dp2_checkpoint_resumes_at_dp1(dp2_then_dp1) -> None:
    _, a, b = dp2_then_dp1
    assert all(o["resumed"]["from"] is None and o["diff"] < 1e-12 for o in a), [o["diff"] for o in a]
    _check_resume(a, b, 2)
    assert all(o["diff"] < 1e-12 for o in b), [o["diff"] for o in b]


@pytest.mark.slow  # a third launch (4 processes)
def test_dp1_checkpoint_resumes_at_zero1_dp2(dp2_then_dp1) -> None:
    ckpt, _, b = dp2_then_dp1
    c = run_ranks(_worker, 4, ckpt, 2, "zero1", 6, timeout=240)  # back to DP2 ZeRO-1: resumes at 4
    _check_resume(b, c, 4)
    assert all(o["diff"] < 1e-12 for o in c), [o["diff"] for o in c]
