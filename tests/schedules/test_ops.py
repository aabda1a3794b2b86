"""The op-semantics module: what each kind waits for, makes, costs and holds — checked by hand values
and against every other view of the rule (flat tables, simulator, lowering)."""

from __future__ import annotations

import json

import pytest

from mt_dualpipe.schedules import Costs, build_schedule, lower, simulate
from mt_dualpipe.schedules.costs import Costs as CostsCls
from mt_dualpipe.schedules.ir import FB, Op
from mt_dualpipe.schedules.ops import (
    ACT,
    COMM_SHAPES,
    GRAD,
    SEND_RECV,
    Need,
    OpKind,
    OpTable,
    activation_effect,
    destination,
    item_producers,
    makes,
    needs,
    op_cost,
    producers,
    rule,
    signal_key,
)
from mt_dualpipe.schedules.placements import dual, linear, v_shape
from tests.helpers.schedules import all_buildable

K = OpKind


def test_kinds_equal_their_strings_and_hash_alike() -> None:
    assert K.F == "F" and K.BW == "BW" and K.SEND_B == "SEND_B"
    assert {"F": 1}[K.F] == 1 and {K.W: 2}["W"] == 2
    assert f"{K.FB}" == "FB" and str(K.RECV_F) == "RECV_F"
    assert json.dumps({"op": K.BW}) == '{"op": "BW"}'
    assert Op(K.F, 0, 1, 2) == Op("F", 0, 1, 2) and hash(Op(K.F, 0, 1, 2)) == hash(Op("F", 0, 1, 2))


def test_producers_on_a_v_placement_by_hand() -> None:
    place = v_shape(2)  # chain 0: stages 0..3 on ranks 0, 1, 1, 0
    assert producers(Op(K.F, 0, 0, 5), place) == ()
    assert producers(Op(K.F, 0, 2, 5), place) == (Need(ACT, 0, 1, 5, 1),)
    assert producers(Op(K.B, 0, 1, 5), place) == (Need(ACT, 0, 1, 5, 1), Need(GRAD, 0, 2, 5, 1))
    assert producers(Op(K.BW, 0, 3, 5), place) == (Need(ACT, 0, 3, 5, 0),)  # last stage: the loss is local
    assert producers(Op(K.W, 0, 2, 5), place) == (Need(GRAD, 0, 2, 5, 1),)
    fb = FB(Op(K.F, 0, 2, 6), Op(K.B, 0, 1, 5))
    assert item_producers(fb, place) == (Need(ACT, 0, 1, 6, 1), Need(ACT, 0, 1, 5, 1), Need(GRAD, 0, 2, 5, 1))
    assert str(Need(GRAD, 0, 2, 5, 1)) == "B(c0,s2,m5)"


def test_makes_and_destination() -> None:
    place = dual(4)  # chain 1 runs stage s on rank 3 - s
    assert makes(Op(K.F, 1, 0, 3)) == (ACT, 1, 0, 3) and destination(Op(K.F, 1, 0, 3), place) == (1, 2)
    assert makes(Op(K.BW, 1, 2, 3)) == (GRAD, 1, 2, 3) and destination(Op(K.BW, 1, 2, 3), place) == (1, 2)
    assert makes(Op(K.W, 1, 2, 3)) is None and destination(Op(K.W, 1, 2, 3), place) is None
    assert destination(Op(K.F, 1, 3, 3), place) is None  # the last stage's output feeds the loss
    assert destination(Op(K.B, 1, 0, 3), place) is None  # the first stage's input-grad goes nowhere


def test_signal_keys_are_the_flat_numbering() -> None:
    S, M = 4, 6
    assert signal_key(ACT, 0, 0, 0, S, M) == 0
    assert signal_key(GRAD, 0, 0, 0, S, M) == 1
    assert signal_key(ACT, 1, 2, 5, S, M) == 2 * ((1 * S + 2) * M + 5)
    assert signal_key(GRAD, 1, 2, 5, S, M) == 2 * ((1 * S + 2) * M + 5) + 1


def test_costs_and_activation_effects() -> None:
    sc = CostsCls(f=[1, 2], b=[3, 4], w=[5, 6], a2a_f=0.5, a2a_b=0.25).per_stage(2)
    assert op_cost(Op(K.F, 0, 1, 0), sc) == 2.5
    assert op_cost(Op(K.B, 0, 0, 0), sc) == 3.25
    assert op_cost(Op(K.W, 0, 1, 0), sc) == 6
    assert op_cost(Op(K.BW, 0, 1, 0), sc) == 4 + 6 + 0.25
    assert op_cost(FB(Op(K.F, 0, 0, 1), Op(K.BW, 0, 1, 0)), sc) == 1 + 4 + 6  # all-to-all hidden
    assert activation_effect(Op(K.F, 0, 0, 0)) == (1, 0)
    assert activation_effect(Op(K.B, 0, 0, 0)) == (0, 0)
    assert activation_effect(Op(K.W, 0, 0, 0)) == (0, 1)
    assert activation_effect(FB(Op(K.F, 0, 0, 1), Op(K.BW, 0, 1, 0))) == (1, 1)


def test_recompute_is_paid_once_in_the_backward() -> None:
    sc = CostsCls(f=2, b=3, w=4, recompute=[0.5, 1.5]).per_stage(2)
    assert op_cost(Op(K.F, 0, 1, 0), sc) == 2
    assert op_cost(Op(K.B, 0, 1, 0), sc) == 3 + 1.5
    assert op_cost(Op(K.W, 0, 1, 0), sc) == 4  # W reuses what B recomputed
    assert op_cost(Op(K.BW, 0, 0, 0), sc) == 3 + 4 + 0.5
    assert op_cost(FB(Op(K.F, 0, 0, 1), Op(K.B, 0, 1, 0)), sc) == 2 + 3 + 1.5
    base = simulate(build_schedule("1f1b", 2, 4), Costs(2, 3, 4)).makespan
    assert simulate(build_schedule("1f1b", 2, 4), Costs(2, 3, 4, recompute=1)).makespan > base


def test_comm_shapes_follow_where_signals_travel() -> None:
    assert SEND_RECV[ACT] == (K.SEND_F, K.RECV_F) and SEND_RECV[GRAD] == (K.SEND_B, K.RECV_B)
    # (producing-stage offset, peer-stage offset, key bit, is a send)
    got = {k: (v.producer, v.peer_offset, v.bit, v.is_send) for k, v in COMM_SHAPES.items()}
    assert got == {"SEND_F": (0, 1, 0, True), "RECV_F": (-1, -1, 0, False),
                   "SEND_B": (0, -1, 1, True), "RECV_B": (1, 1, 1, False)}


def test_unknown_kind_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown op kind 'X'; allowed F, B, W, BW"):
        rule("X")
    with pytest.raises(ValueError, match="unknown op kind"):
        needs(Op("X", 0, 0, 0), 2)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_flat_tables_agree_with_producers_for_every_schedule(P: int, M: int) -> None:
    for s in all_buildable(P, M):
        S = s.num_stages()
        table = OpTable(s.placement, M)
        for ops in s.ranks:
            for item in ops:
                for op in (item.f, item.b) if type(item) is FB else (item,):
                    want = [(signal_key(n.signal, n.chain, n.stage, n.mb, S, M), n.rank, n.stage)
                            for n in producers(op, s.placement)]
                    assert table.waits(op) == want, (s.name, op)
                    made = makes(op)
                    assert table.made(op) == (signal_key(*made, S, M) if made else -1)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_every_cross_rank_need_is_one_transfer_of_the_lowered_program(P: int, M: int) -> None:
    for s in all_buildable(P, M):
        want = set()
        for r, ops in enumerate(s.ranks):
            for item in ops:
                for op in (item.f, item.b) if type(item) is FB else (item,):
                    want |= {(n.signal, n.chain, n.stage, n.mb, n.rank, r) for n in producers(op, s.placement)
                             if n.rank != r}
        got = set()
        for r, ins in enumerate(lower(s).ranks):
            for batch in ins:
                for c in getattr(batch, "ops", ()):
                    shape = COMM_SHAPES[c.kind]
                    if not shape.is_send:
                        got.add((shape.signal, c.chain, c.stage + shape.producer, c.mb, c.peer, r))
        assert got == want, s.name


def test_simulator_reports_each_ranks_end() -> None:
    s = build_schedule("1f1b", 4, 8)
    r = simulate(s, Costs(1, 2, 0))
    assert r.rank_end == [max(e.end for e in r.timeline if e.rank == k) for k in range(4)]
    assert max(r.rank_end) == r.makespan


def test_linear_placement() -> None:
    assert linear(3) == ((0, 1, 2),)
