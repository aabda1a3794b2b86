"""Measured-vs-simulated bubble: per-stage costs and hop latency read back from a timeline, and the
breakdown of what separates a measured bubble from the simulated one.

A simulated timeline is a "measurement" whose truth is known: reading it back must give the costs
and latency it was simulated with and no variance or overhead. Hand-made perturbations of it (one
slow op, one op started late) must land in exactly the part of the breakdown they belong to.
"""

from __future__ import annotations

import pytest

from mt_dualpipe.schedules import Costs, build_schedule, simulate
from mt_dualpipe.schedules.timeline import Timeline, TimelineEvent
from mt_dualpipe.visualize.measured import compare_bubble, hop_latency, replay_bubble, stage_costs
from mt_dualpipe.visualize.metrics import Summary

STAGE_COSTS = dict(f=[1.0, 2.0, 3.0, 4.0], b=[2.0, 3.0, 4.0, 5.0], w=[0.5, 1.0, 1.5, 2.0])


def stage_costs_for(num_stages: int, **kw) -> Costs:
    """The first ``num_stages`` entries of STAGE_COSTS."""
    return Costs(**{k: v[:num_stages] for k, v in STAGE_COSTS.items()}, **kw)


def timeline_of(name: str, P: int, M: int, costs: Costs) -> tuple:
    sched = build_schedule(name, P, M)
    return sched, simulate(sched, costs).to_timeline()


@pytest.mark.parametrize("name", ["zbv", "zb-h1", "1f1b"])
def test_stage_costs_read_back_the_simulated_per_stage_costs(name):
    P = 2 if name == "zbv" else 4
    sched, tl = timeline_of(name, P, 2 * P, Costs(**STAGE_COSTS, comm=0.25))
    got = stage_costs(tl, 4)
    assert got.f == pytest.approx(STAGE_COSTS["f"])
    if sched.splits_backward:
        assert got.b == pytest.approx(STAGE_COSTS["b"]) and got.w == pytest.approx(STAGE_COSTS["w"])
    else:  # BW only: the whole backward sits in b
        assert got.b == pytest.approx([b + w for b, w in zip(STAGE_COSTS["b"], STAGE_COSTS["w"])])
        assert got.w == [0.0] * 4
    assert got.fb is None


def test_dualpipev_fb_units_are_read_per_f_stage():
    """DualPipeV pairs F of stage s with the backward of stage 2P-1-s on the same rank: fb[s] = f[s] + BW[2P-1-s]."""
    sched, tl = timeline_of("dualpipev", 2, 8, Costs(**STAGE_COSTS))
    got = stage_costs(tl, 4)
    f, b, w = STAGE_COSTS["f"], STAGE_COSTS["b"], STAGE_COSTS["w"]
    assert got.fb == pytest.approx([f[s] + b[3 - s] + w[3 - s] for s in range(4)])


@pytest.mark.parametrize("name,P,M", [("dualpipe", 2, 4), ("dualpipe", 4, 8), ("zbv", 2, 4), ("1f1b", 4, 8),
                                      ("dualpipev", 2, 4), ("zb-h2", 4, 8)])
def test_a_simulated_run_is_explained_entirely_by_costs_and_latency(name, P, M):
    S = build_schedule(name, P, M).num_stages()
    sched, tl = timeline_of(name, P, M, stage_costs_for(S, comm=0.3))
    bd = compare_bubble(tl, sched)
    assert bd.hop_latency == pytest.approx(0.3)
    assert bd.simulated == pytest.approx(bd.measured) and bd.replayed == pytest.approx(bd.measured)
    assert bd.variance == pytest.approx(0.0, abs=1e-12) and bd.overhead == pytest.approx(0.0, abs=1e-12)
    assert bd.communication == pytest.approx(bd.simulated - simulate(sched, stage_costs_for(S)).bubble_rate)
    assert bd.communication > 0


def test_dualpipe_at_two_ranks_says_the_schedule_has_no_bubble_and_the_rest_is_communication():
    sched, tl = timeline_of("dualpipe", 2, 4, Costs(1.0, 2.0, 1.0, comm=0.25))
    bd = compare_bubble(tl, sched)
    assert bd.compute_only == 0.0 and bd.measured > 0.0
    text = bd.explain()
    assert "the schedule itself has no bubble at these costs" in text
    assert f"+{100 * bd.measured:.1f} points communication (hop latency)" in text
    assert "variance" not in text and "overhead" not in text


def shifted(tl: Timeline, pick, delay: float, stretch: bool) -> Timeline:
    """``tl`` with the picked event delayed (or stretched) by ``delay`` and everything after it on any rank
    moved by the same amount (dependencies stay satisfied)."""
    target = next(e for e in tl.events if pick(e))
    cut = target.start
    events = []
    for e in tl.events:
        if e is target:
            events.append(e._replace(start=e.start + (0 if stretch else delay), end=e.end + delay))
        elif e.start > cut:
            events.append(e._replace(start=e.start + delay, end=e.end + delay))
        else:
            events.append(e)
    return Timeline(tl.name, tl.num_ranks, tl.num_microbatches, events, "measured")


def test_a_late_start_is_runtime_overhead_and_a_slow_op_is_variance():
    sched, tl = timeline_of("1f1b", 2, 4, Costs(1.0, 2.0, 0.0, comm=0.1))
    base = compare_bubble(tl, sched)

    def pick(e):
        return e.rank == 1 and e.op == "F" and e.mb == 2

    late = compare_bubble(shifted(tl, pick, 0.5, stretch=False), sched)
    assert late.overhead == pytest.approx(late.measured - base.measured) and late.overhead > 0
    assert late.variance == pytest.approx(0.0, abs=1e-12)
    slow = compare_bubble(shifted(tl, pick, 0.5, stretch=True), sched)
    assert slow.overhead == pytest.approx(0.0, abs=1e-12)
    assert slow.variance == pytest.approx(slow.replayed - slow.simulated) and slow.variance != 0
    assert slow.replayed == pytest.approx(slow.measured)


def test_a_reduction_past_the_last_op_is_its_own_part_not_overhead():
    """DualPipe's mirrored stages all-reduce their gradients after their last backward: a reduction that ends
    after every rank's last op lengthens the step, and that tail is named as such (not runtime overhead)."""
    sched, tl = timeline_of("dualpipe", 2, 4, Costs(1.0, 2.0, 1.0, comm=0.25))
    base = compare_bubble(tl, sched)
    last = max(e.end for e in tl.events)
    tail = 1.5
    reduces = [TimelineEvent(r, "REDUCE_GRAD", 0, r, -1, last - 0.5, last + tail, lane="comm") for r in range(2)]
    got = compare_bubble(Timeline(tl.name, tl.num_ranks, tl.num_microbatches, [*tl.events, *reduces], "measured"),
                         sched)
    busy = Summary.from_timeline(tl).busy
    span = last - min(e.start for e in tl.events)
    assert got.measured == pytest.approx(sum(span + tail - b for b in busy) / (2 * (span + tail)))
    assert got.to_last_op == pytest.approx(base.measured)
    assert got.reduction == pytest.approx(got.measured - base.measured) and got.reduction > 0
    assert got.overhead == pytest.approx(0.0, abs=1e-12) and got.variance == pytest.approx(0.0, abs=1e-12)
    assert f"+{100 * got.reduction:.1f} points gradient reductions after the last op" in got.explain()
    assert "gradient reductions" not in base.explain()


def test_replay_without_latency_of_a_simulation_is_its_bubble():
    sched, tl = timeline_of("zbv", 2, 8, Costs(**STAGE_COSTS))
    assert replay_bubble(tl, sched.placement, 0.0) == pytest.approx(Summary.from_timeline(tl).bubble_rate)
    assert hop_latency(tl, sched.placement) == 0.0


def test_stage_index_outside_the_chain_is_refused():
    _, tl = timeline_of("1f1b", 2, 2, Costs())
    with pytest.raises(ValueError, match="names stage 1, but the chain has 1 stages"):
        stage_costs(tl, 1)
