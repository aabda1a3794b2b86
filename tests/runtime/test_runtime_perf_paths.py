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
from mt_dualpipe.runtime.executor import Executor, PlannedOp
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from mt_dualpipe.schedules import build_schedule
from mt_dualpipe.schedules.ir import Op, Program, compute_parts
from mt_dualpipe.schedules.lower import lower
from mt_dualpipe.schedules.ops import OpKind
from tests.helpers.dist import run_ranks


class _Unconnected:
    """Planning binds ``take`` of the rank's P2P without calling it; no step runs in these tests."""

    def take(self, key, consumer, requires_grad):
        raise AssertionError("planning must not receive")


def _executor(name: str, P: int, M: int, rank: int) -> Executor:
    sched = build_schedule(name, P, M)
    mods = [nn.Linear(2, 2) for _ in sched.local_stages(rank)]
    return Executor(lower(sched), rank, mods, _Unconnected(), WeightGradStore())


def _source(entry: PlannedOp) -> object:
    """What a planned op's ``fetch`` is bound to: (function name, arguments)."""
    f = entry.fetch
    return (f.func.__name__, f.args) if hasattr(f, "func") else (f.__name__, ())


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_resolves_every_source_once(rank):
    ex = _executor("dualpipev", 2, 4, rank)
    plan = ex.plan(False)
    assert plan is ex.plan(False)  # built once per program
    whole = {OpKind.COMM: lambda e: e.batch, OpKind.FB: lambda e: e.item}
    assert [(e.index, whole.get(e.kind, lambda e: e.op)(e)) for e in plan] == list(enumerate(ex.program.ranks[rank]))
    placement = ex.placement[0]  # dualpipev: one chain of 4 stages in a V over 2 ranks
    ops = [x for e in plan if e.kind is not OpKind.COMM for x in ((e.f, e.b) if e.kind is OpKind.FB else (e,))]
    assert any(e.kind is OpKind.FB for e in plan)
    for e in ops:
        ins = e.op
        assert e.stage is ex.stages[ins.chain, ins.stage]
        s, m = ins.stage, ins.mb
        src = _source(e) if e.fetch is not None else None
        if e.kind is OpKind.F:
            if s == 0:
                assert src == ("_step_inputs", (ins,))
            elif placement[s - 1] == rank:
                assert src == ("_handed_over", (ex.stages[0, s - 1], m))  # the turn of the V: handed over locally
            else:
                assert src == ("take", (("F", 0, s - 1, m), (e.index, ins), True))
        elif e.kind in (OpKind.B, OpKind.BW):
            if s == len(placement) - 1:
                assert src == ("_no_grads", ())
            elif placement[s + 1] == rank:
                assert src == ("take_input_grads", (m,)) and e.fetch.func.__self__ is ex.stages[0, s + 1]
            else:
                assert src == ("take", (("B", 0, s + 1, m), (e.index, ins), False))
        else:
            assert e.kind is OpKind.W and src is None
    posts = [e for e in plan if e.kind is OpKind.COMM]
    kinds = sorted(pc.op.kind for e in posts for pc in e.comms)
    n_comm = sum(len(ins.ops) for ins in ex.program.ranks[rank] if type(ins).__name__ == "CommBatch")
    assert len(kinds) == n_comm and n_comm > 0
    for pc in (pc for e in posts for pc in e.comms):  # a send's key is its own signal, a receive's its producer's
        c = pc.op
        expected = {"SEND_F": ("F", c.stage), "RECV_F": ("F", c.stage - 1), "SEND_B": ("B", c.stage),
                    "RECV_B": ("B", c.stage + 1)}[c.kind]
        assert pc.key == (expected[0], c.chain, expected[1], c.mb)


def test_plan_plans_fb_units_like_plain_ops():
    ex = _executor("dualpipe", 2, 4, 0)
    units = [e for e in ex.plan(False) if e.kind is OpKind.FB]
    assert units, "dualpipe at P=2, M=4 has F&B units"
    for u in units:
        assert (u.f.kind, u.f.op) == (OpKind.F, u.item.f) and u.b.op == u.item.b
        assert u.b.kind in (OpKind.B, OpKind.BW) and u.overlapped is None  # nn.Linear has no overlapped F&B


def test_plan_forward_only_keeps_forward_ops_and_messages():
    ex = _executor("zbv", 2, 4, 1)
    plan = ex.plan(True)
    assert {e.kind for e in plan} <= {OpKind.F, OpKind.COMM}
    assert sum(e.kind is OpKind.F for e in plan) == 2 * 4  # two stages on rank 1, four micro-batches
    assert all(pc.op.kind in ("SEND_F", "RECV_F") for e in plan if e.kind is OpKind.COMM for pc in e.comms)


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
    p2p.link.open(p2p.timeout)  # the pipeline's link (link.py): the first step's rendezvous is not what is timed
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


def _one_rank_agreement_worker(rank, world):
    import torch.distributed as dist

    from mt_dualpipe.runtime.comm import P2P

    group = dist.distributed_c10d._get_default_group()
    p2p = P2P(rank, [0], group, torch.device("cpu"), timeout=20)
    seen = []
    p2p.on_agreement = seen.append
    p2p.begin_step(("inputs", 8), (7, 8))
    posted = p2p.agreement[0] is not None
    first = p2p.settle()
    same = p2p.start_step(("inputs", 8))
    changed = p2p.start_step(("inputs", 16))
    p2p.finish((0, "end of step"))
    return {"posted": posted, "first": first, "same": same, "changed": changed, "rows": seen[0], "ended": p2p.ended}


def test_one_rank_agrees_with_itself_without_collectives():
    """A pipeline of one rank posts neither all-reduce; its own row still goes to ``on_agreement`` and an input
    change still makes it relearn."""
    (res,) = run_ranks(_one_rank_agreement_worker, 1, timeout=60)
    assert res["posted"] is False and res["ended"] is True
    assert res["rows"] == [[7, 8]]
    assert res["first"] is True and res["same"] is False and res["changed"] is True


def test_a_fused_bw_builds_plain_nodes_for_deferring_linears():
    """The executor marks the micro-batches whose backward the schedule runs fused; their F builds the plain
    autograd node of a ``DeferredLinear`` (no Python ``autograd.Function`` for a split that never comes), except
    under saved-tensor hooks (a checkpoint region must save in its recompute what its forward saved)."""
    from torch.autograd.function import BackwardCFunction

    from mt_dualpipe.runtime.deferred import DeferredLinear
    from mt_dualpipe.runtime.weight_grad import fused_forward

    sched = build_schedule("dualpipev", 1, 4)
    ex = Executor(lower(sched), 0, [DeferredLinear(2, 2), DeferredLinear(2, 2)], _Unconnected(), WeightGradStore())
    bw = {(i.chain, i.stage, i.mb) for item in ex.program.compute_ops(0) for i in compute_parts(item)
          if i.kind == OpKind.BW}
    assert bw and all(mb in ex.stages[c, s].fused for c, s, mb in bw)
    assert all((c, s, mb) in bw for (c, s), st in ex.stages.items() for mb in st.fused)
    lin, x = DeferredLinear(2, 2), torch.randn(3, 2, requires_grad=True)
    assert isinstance(lin(x).grad_fn, BackwardCFunction)
    with fused_forward():
        assert not isinstance(lin(x).grad_fn, BackwardCFunction)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert isinstance(lin(x).grad_fn, BackwardCFunction)
