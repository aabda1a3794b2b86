"""The runtime's fast paths: the per-program plan the executor builds once, and the step's shape
agreement, posted when the step begins and settled only at the first post (so a rank can compute
before it), which still makes every rank relearn together when any rank's inputs change or any
rank's last step failed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime.errors import PipelineError
from mt_dualpipe.runtime.executor import _B, _BW, _F, _FB, _LAST, _POST, _W, Executor
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from mt_dualpipe.schedules import build_schedule
from mt_dualpipe.schedules.ir import Op, Program
from mt_dualpipe.schedules.lower import lower
from tests.helpers.dist import run_ranks


def _executor(name: str, P: int, M: int, rank: int) -> Executor:
    sched = build_schedule(name, P, M)
    mods = [nn.Linear(2, 2) for _ in sched.local_stages(rank)]
    return Executor(lower(sched), rank, mods, None, WeightGradStore())


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_resolves_every_source_once(rank):
    ex = _executor("dualpipev", 2, 4, rank)
    plan = ex.plan(False)
    assert plan is ex.plan(False)  # built once per program
    assert [(i, ins) for _, i, ins, _, _ in plan] == list(enumerate(ex.program.ranks[rank]))
    placement = ex.placement[0]  # dualpipev: one chain of 4 stages in a V over 2 ranks
    for code, _, ins, st, src in plan:
        if code in (_POST, _FB):
            continue
        assert st is ex.stages[ins.chain, ins.stage]
        s, m = ins.stage, ins.mb
        if code == _F:
            if s == 0:
                assert src is None
            elif placement[s - 1] == rank:
                assert src is ex.stages[0, s - 1]  # the turn of the V: handed over locally
            else:
                assert src == ("F", 0, s - 1, m)
        elif code in (_B, _BW):
            if s == len(placement) - 1:
                assert src is _LAST
            elif placement[s + 1] == rank:
                assert src is ex.stages[0, s + 1]
            else:
                assert src == ("B", 0, s + 1, m)
        else:
            assert code == _W and src is None
    posts = [a for code, _, _, a, _ in plan if code == _POST]
    kinds = sorted(c.kind for comms in posts for _, c, _, _ in comms)
    n_comm = sum(len(ins.ops) for ins in ex.program.ranks[rank] if type(ins).__name__ == "CommBatch")
    assert len(kinds) == n_comm and n_comm > 0


def test_plan_forward_only_keeps_forward_ops_and_messages():
    ex = _executor("zbv", 2, 4, 1)
    plan = ex.plan(True)
    assert {code for code, *_ in plan} <= {_F, _POST}
    assert sum(code == _F for code, *_ in plan) == 2 * 4  # two stages on rank 1, four micro-batches
    assert all(c.kind in ("SEND_F", "RECV_F") for code, _, _, a, _ in plan if code == _POST for _, c, _, _ in a)


def test_plan_refuses_an_op_of_a_stage_the_rank_does_not_run():
    sched = build_schedule("1f1b", 2, 2)
    prog = lower(sched)
    bad = Program(sched, [list(r) for r in prog.ranks])
    bad.ranks[0].insert(0, Op("F", 0, 1, 0))  # stage 1 runs on rank 1
    ex = Executor(bad, 0, [nn.Linear(2, 2)], None, WeightGradStore())
    with pytest.raises(PipelineError, match=r"rank 0: instruction 0 F.* names a stage this rank does not run"):
        ex.plan(False)


def _agreement_worker(rank, world):
    import torch.distributed as dist

    from mt_dualpipe.runtime.comm import P2P

    group = dist.distributed_c10d._get_default_group()
    p2p = P2P(rank, list(range(world)), group, torch.device("cpu"), timeout=20)
    out = {}
    # step 1: rank 1 starts late; rank 0's begin_step must not wait for it
    if rank == 1:
        time.sleep(1.0)
    t0 = time.monotonic()
    p2p.begin_step(("inputs", 8))
    out["begin_s"] = time.monotonic() - t0
    p2p.cache[("F", 0, 0, 0)] = "learned"
    out["first"] = p2p.settle()  # no fingerprint yet: everyone learns
    p2p.cache[("F", 0, 0, 0)] = "learned"
    out["same"] = p2p.start_step(("inputs", 8))  # nothing changed anywhere: keep
    out["kept"] = ("F", 0, 0, 0) in p2p.cache
    # only rank 0's inputs change: both ranks drop their caches
    out["one_changed"] = p2p.start_step(("inputs", 16 if rank == 0 else 8))
    out["dropped"] = not p2p.cache
    p2p.cache[("F", 0, 0, 0)] = "learned"
    # rank 1's step fails (forget): next step both relearn although no input changed
    if rank == 1:
        p2p.forget()
    out["after_failure"] = p2p.start_step(("inputs", 16 if rank == 0 else 8))
    out["dropped_after_failure"] = not p2p.cache
    dist.barrier()
    return out


def test_agreement_is_lazy_and_every_rank_relearns_together():
    res = run_ranks(_agreement_worker, 2, timeout=60)
    assert res[0]["begin_s"] < 0.5  # posted, not waited for: rank 1 was still asleep
    for r in res:
        assert r["first"] is True
        assert r["same"] is False and r["kept"]
        assert r["one_changed"] is True and r["dropped"]
        assert r["after_failure"] is True and r["dropped_after_failure"]
