"""``Pipeline.rebuilt()``: the same pipeline (class, stage modules, schedule, options, mapping,
timeout) on a fresh process group, which is what a fault-tolerant loop needs after a failed step."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.helpers.dist import run_ranks


def _worker(rank, world):
    from mt_dualpipe import DualPipeV, Pipeline

    torch.manual_seed(0)
    out = {}
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    mapped = Pipeline([nn.Linear(4, 4)], "1f1b", rank_mapping=[1, 0], timeout=30)
    mapped.timeout = 12.5
    mapped.record_timeline = True
    new = mapped.rebuilt()
    out["mapped"] = (type(new).__name__, new.rank, new.rank_mapping, new.timeout, new.record_timeline,
                     new.group is not mapped.group, all(a is b for a, b in zip(new.module, mapped.module)))
    losses = []
    for pipe in (mapped, new):
        loss, _ = pipe.step(*((x,) if pipe.needs_inputs else ()), num_chunks=2, criterion=nn.functional.mse_loss,
                            labels=(y,) if pipe.needs_labels else ())
        losses.append(loss)
    out["same_loss"] = losses[0] is None or torch.equal(losses[0], losses[1])
    v = DualPipeV((nn.Linear(4, 4), nn.Linear(4, 4)), batch_dim=1)
    nv = v.rebuilt()
    out["v"] = (type(nv).__name__, nv.batch_dim, nv.placement == v.placement)
    return out


def test_rebuilt_keeps_everything_but_the_group():
    res = run_ranks(_worker, 2, timeout=120)
    for rank, r in enumerate(res):
        assert r["mapped"] == ("Pipeline", 1 - rank, [1, 0], 12.5, True, True, True)
        assert r["same_loss"] and r["v"] == ("DualPipeV", 1, True)
