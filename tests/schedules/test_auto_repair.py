"""The repairs of annealed orders (``repair``: cool-down re-listing, stray pairing) and the list-scheduling
walk with a prefix they rest on."""

from __future__ import annotations

from mt_dualpipe.schedules import Costs, build_schedule, validate
from mt_dualpipe.schedules.auto import Layout, Policy, list_schedule
from mt_dualpipe.schedules.auto import repair as repair_module
from mt_dualpipe.schedules.auto.listsched import list_schedules_from
from mt_dualpipe.schedules.auto.local import close_gaps, evaluate, renumber, split_backward
from mt_dualpipe.schedules.auto.repair import (
    anneal_repaired,
    cooldown_policies,
    pair_strays,
    prefix_before,
    relist_cooldown,
    stray_pairings,
)
from mt_dualpipe.schedules.ir import FB, Op
from mt_dualpipe.schedules.ops import OpKind
from mt_dualpipe.schedules.simulate import Replay, run_schedule
from tests.helpers.schedules import ops_of, order_of, random_walk_orders

TWO = Layout.named("linear", 2, 2)


def test_a_walk_runs_its_prefix_as_given_then_chooses():
    layout, costs = Layout.named("v", 3, 6), Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    sc = costs.per_stage(layout.S)
    full = list_schedule(layout, sc, [6] * 3, Policy(pair=True))
    assert list_schedule(layout, sc, [6] * 3, Policy(), prefix=full) == full  # all of it given: the same order
    head = [ops[:len(ops) // 2] for ops in full]
    other = Policy(deep_first=False)
    got = list_schedule(layout, sc, [6] * 3, other, prefix=head)
    assert [ops[:len(h)] for ops, h in zip(got, head)] == head
    # the rest is the other policy's choice: neither the order the prefix came from nor that policy's own walk
    assert got != full and got != list_schedule(layout, sc, [6] * 3, other)
    assert [sorted(map(str, ops)) for ops in got] == [sorted(map(str, ops)) for ops in full]
    validate(order_of(layout, got))
    # a prefix whose F's skip a micro-batch of their stage cannot be run: the walk says so
    assert list_schedule(TWO, Costs(1, 1, 1).per_stage(2), [2, 2], Policy(), prefix=[ops_of(0, "F1"), []]) is None
    # nor a W whose B has not run
    assert list_schedule(TWO, Costs(1, 1, 1).per_stage(2), [2, 2], Policy(), prefix=[ops_of(0, "F0 W0"), []]) is None


def test_relisting_runs_the_ready_b_before_the_w():
    # P=2, M=2, every op 1. Rank 1 runs W0 (4..5) although B1's input (its own F1) was there at 4, so
    # rank 0 waits 4..6 for B1: makespan 9. Cut at 0.4 of it (3.6), each rank keeps what started before
    # (rank 0: F0 F1 B0 from 3; rank 1: F0 B0 F1 from 3) and the walk runs rank 1's B1 at 4, rank 0's W0
    # in its wait and B1 at 5: makespan 7.
    costs, ranks = Costs(1, 1, 1), [ops_of(0, "F0 F1 B0 B1 W0 W1"), ops_of(1, "F0 B0 F1 W0 B1 W1")]
    assert run_schedule(order_of(TWO, ranks), costs).makespan == 9
    relisted, makespan = relist_cooldown(TWO, costs, [2, 2], ranks, cuts=(0.4,))
    assert makespan == 7
    assert relisted == [ops_of(0, "F0 F1 B0 W0 B1 W1"), ops_of(1, "F0 B0 F1 B1 W0 W1")]
    assert run_schedule(order_of(TWO, relisted), costs).makespan == 7


def test_relisted_orders_are_valid_within_the_limit_and_keep_each_ranks_ops():
    for layout, costs, limits, ranks in random_walk_orders(11, (0, 3)):
        relisted, makespan = relist_cooldown(layout, costs, limits, ranks)
        res = run_schedule(order_of(layout, relisted), costs, record=False)
        validate(order_of(layout, relisted))
        assert res.makespan == makespan
        assert all(p <= lim for p, lim in zip(res.peak_activations, limits))
        assert [sorted(map(str, ops)) for ops in relisted] == [sorted(map(str, ops)) for ops in ranks]
        assert makespan <= run_schedule(order_of(layout, ranks), costs, record=False).makespan  # never worse
        # a cut past the end keeps the whole order: what is left is gap closing alone
        closed = close_gaps(layout, costs, limits, ranks)
        assert relist_cooldown(layout, costs, limits, ranks, cuts=(1.01,)) == (closed[0], closed[1])
        # past the deadline nothing is walked or moved: the order comes back as it was
        given = run_schedule(order_of(layout, ranks), costs, record=False).makespan
        assert relist_cooldown(layout, costs, limits, ranks, deadline=0.0) == (ranks, given)


def test_the_prefix_is_what_started_before_the_cut():
    layout, costs = Layout.named("v", 3, 6), Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    ranks = list_schedule(layout, costs.per_stage(layout.S), [6] * 3, Policy(pair=True))
    replay = Replay(order_of(layout, ranks), costs)
    cut = 0.5 * replay.makespan
    prefix = prefix_before(ranks, replay, cut)
    for r, ops in enumerate(ranks):
        starts = [a for a, _ in replay.times(r)]
        assert prefix[r] == ops[:len(prefix[r])]
        assert all(a < cut for a in starts[:len(prefix[r])]) and all(a >= cut for a in starts[len(prefix[r]):])
    # the policies split backwards (annealed orders run B then W) and leave out the warm-up-only choices
    pols = cooldown_policies("v", costs, layout.S)
    assert pols and all(p.split and not p.inject_first and not p.pair_wait for p in pols)
    assert {p.pair for p in pols} == {False, True}
    assert {p.pair for p in cooldown_policies("linear", costs, 4)} == {False}


def test_the_search_relists_the_cooldown_of_its_bestorder_of(monkeypatch):
    calls = []
    real = repair_module.relist_cooldown

    def spy(layout, costs, limits, ranks, *args, **kwargs):
        out = real(layout, costs, limits, ranks, *args, **kwargs)
        calls.append((ranks, out))
        return out

    monkeypatch.setattr(repair_module, "relist_cooldown", spy)
    paired = []
    real_pairs = repair_module.pair_strays
    monkeypatch.setattr(repair_module, "pair_strays",
                        lambda *a: paired.append(a[3]) or real_pairs(*a))
    # V, P=4, M=8, all-to-all 1.0 of F: the phases end at 76 with gaps closed; re-listing the cool-down gives 75
    costs = Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    sched = build_schedule("auto", 4, 8, costs=costs, placement="v", seed=0, iterations=5)
    # the best order of the phases (no hand chains with iterations given), then the two best stray pairings
    assert len(calls) == 1 + repair_module.STRAY_RELISTS
    before, (relisted, makespan) = calls[0]
    layout = Layout.named("v", 4, 8)
    assert run_schedule(order_of(layout, before), costs, record=False).makespan == 76
    assert sched.meta["source"].endswith("+gaps+cooldown")
    assert sched.ranks == relisted and run_schedule(sched, costs, record=False).makespan == makespan == 75
    assert paired == [relisted]  # stray pairing starts from the re-listed order, and found nothing better here
    # a linear placement has no FB units to pair: the cool-down is re-listed, no strays are looked for
    build_schedule("auto", 3, 6, costs=Costs(1, 2, 1, comm=0.5), placement="linear", seed=0, iterations=5)
    assert len(calls) == 2 + repair_module.STRAY_RELISTS and paired == [relisted]


def test_stray_pairings_pair_each_lone_f_with_the_nearest_lone_b_of_the_other_stage():
    # V, P=2: rank 0 holds stages 0 and 3. F0@s0 has no lone B before it; after it the nearest lone B of
    # another stage is B0@s3. F0@s3 has none before; after it B0@s0 (B0@s3 is its own stage's). F1@s0 has
    # B0@s3 before it and none after (B0@s0 is its own stage's).
    f = [Op(OpKind.F, 0, s, m) for s, m in ((0, 0), (3, 0), (0, 1))]
    b = [Op(OpKind.B, 0, s, m) for s, m in ((3, 0), (0, 0), (3, 1))]
    unit = FB(Op(OpKind.F, 0, 3, 1), b[2])
    ops = [f[0], f[1], b[0], f[2], b[1], unit]
    assert stray_pairings(ops) == [
        [FB(f[0], b[0]), f[1], f[2], b[1], unit],  # F0@s0 + B0@s3 where F0@s0 was
        [f[1], FB(f[0], b[0]), f[2], b[1], unit],  # ... where B0@s3 was
        [f[0], FB(f[1], b[1]), b[0], f[2], unit],  # F0@s3 + B0@s0 where F0@s3 was
        [f[0], b[0], f[2], FB(f[1], b[1]), unit],  # ... where B0@s0 was (B0@s3 before its F: it will not run)
        [f[0], f[1], FB(f[2], b[0]), b[1], unit],  # F1@s0 + B0@s3, at either place: the same order
        [f[0], f[1], FB(f[2], b[0]), b[1], unit],
    ]


def test_a_unit_split_on_the_critical_rank_is_paired_again():
    # V, P=3, M=6, all-to-all 1.0 of F: a walk with FB units, one unit of its critical rank split into a
    # lone F and B (each now pays its all-to-all); pairing strays gets back at least the order it came from
    layout, costs = Layout.named("v", 3, 6), Costs(1, 1, 1, a2a_f=1, a2a_b=1)
    ranks = list_schedule(layout, costs.per_stage(layout.S), [6] * 3, Policy(pair=True, w_eager=True, fifo=True))
    ranks = [renumber(ops, 0, len(ops) - 1) for ops in split_backward(ranks)]
    whole = evaluate(layout, costs, ranks)
    crit = max(range(3), key=lambda r: whole[1][r])
    tried = 0
    for u in [i for i, x in enumerate(ranks[crit]) if type(x) is FB]:
        split = list(ranks)
        split[crit] = ranks[crit][:u] + list(ranks[crit][u]) + ranks[crit][u + 1:]
        before = evaluate(layout, costs, split)
        if before is None or before[0] <= whole[0]:
            continue
        paired, makespan = pair_strays(layout, costs, [6] * 3, split)
        validate(order_of(layout, paired))
        assert makespan <= whole[0] < before[0]
        assert makespan == run_schedule(order_of(layout, paired), costs, record=False).makespan
        tried += 1
    assert tried > 0
    # an order whose critical rank has no lone F has nothing to pair
    no_lone = [[x for x in ops if not (type(x) is Op and x.kind == OpKind.F)] for ops in ranks]
    assert all(stray_pairings(ops) == [] for ops in no_lone)


def test_relisting_walks_the_shared_prefix_once_and_gives_each_policys_order():
    """``list_schedules_from`` equals one prefixed walk per policy; ``Replay.from_time`` equals a full simulation."""
    for layout, costs, limits, ranks in random_walk_orders(5, [0, 2]):
        sc = costs.per_stage(layout.S)
        replay = Replay(order_of(layout, ranks), costs)
        for cut in (0.5, 0.8):
            t_cut = cut * replay.makespan
            prefix = prefix_before(ranks, replay, t_cut)
            pols = cooldown_policies(layout.name, costs, layout.S)
            got = list_schedules_from(layout, sc, limits, pols, prefix)
            assert got == [list_schedule(layout, sc, limits, pol, prefix=prefix) for pol in pols]
            for order in {tuple(map(tuple, x)) for x in got if x is not None}:
                new = [list(ops) for ops in order]
                full = run_schedule(order_of(layout, new), costs, record=False)
                part = replay.from_time(new, t_cut)
                assert (part.makespan, part.rank_end, part.peak_activations) == \
                    (full.makespan, full.rank_end, full.peak_activations)
                assert part.walked < sum(len(ops) for ops in new)  # what starts before the cut is not walked


def test_a_repaired_chain_is_never_worse_than_its_start_and_repeats_itself():
    import random

    from mt_dualpipe.schedules.auto import ANNEAL_MOVES

    layout, costs = Layout.named("v", 3, 6), Costs(1, 1, 1, a2a_f=1, a2a_b=1, comm=0.2)
    start = split_backward([list(x) for x in build_schedule("dualpipev", 3, 6).ranks])
    before = evaluate(layout, costs, start)[0]
    runs = [anneal_repaired(layout, costs, [7] * 3, start, random.Random(3), 400, None, ANNEAL_MOVES, 0.006, 20_000,
                            float("-inf"), 2, True) for _ in range(2)]
    (ranks, makespan), again = runs
    assert again == (ranks, makespan)  # seeded: the same order
    assert makespan == evaluate(layout, costs, ranks)[0] < before
    validate(order_of(layout, ranks))
