"""lower() and validate_program(): transfer order, early receives, rendezvous deadlock checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_dualpipe.schedules import (
    FB,
    Comm,
    CommBatch,
    Op,
    Program,
    Schedule,
    ScheduleError,
    build_schedule,
    lower,
    simulate,
    validate,
    validate_program,
)
from tests.helpers.schedules import all_buildable, unit

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- lower ----------------------

@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_lowered_programs_validate(P: int, M: int) -> None:
    schedules = all_buildable(P, M)
    assert any(s.name == "dualpipe" for s in schedules)
    for s in schedules:
        p = lower(s)
        validate_program(p)
        assert simulate(p, unit()).makespan == simulate(s, unit()).makespan
        # one send and one receive per cross-rank edge
        edges = sum(1 for c, chain in enumerate(s.placement) for m in s.microbatches_of(c)
                    for st_ in range(len(chain) - 1) if chain[st_] != chain[st_ + 1])
        assert p.num_comm_ops() == 4 * edges, s.name


def test_lowered_sends_follow_producers_and_recvs_precede_consumers() -> None:
    p = lower(build_schedule("dualpipe", 4, 8))
    for prog in p.ranks:
        done: set = set()
        for ins in prog:
            if type(ins) is CommBatch:
                for c in ins.ops:
                    if c.kind == "SEND_F":
                        assert ("F", c.chain, c.stage, c.mb) in done
                    elif c.kind == "SEND_B":
                        assert ("B", c.chain, c.stage, c.mb) in done
                    elif c.kind == "RECV_F":
                        assert ("F", c.chain, c.stage, c.mb) not in done
                    else:
                        assert ("B", c.chain, c.stage, c.mb) not in done
            else:
                for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                    done.add(("B" if op.kind == "BW" else op.kind, op.chain, op.stage, op.mb))


def test_lowering_posts_receives_as_early_as_the_order_allows() -> None:
    """A receive sits right after the last local op that starts before its producer ends (reference run)."""
    s = build_schedule("dualpipe", 8, 20)
    p = lower(s)
    ref = simulate(s, unit())
    starts: list[list[float]] = [[] for _ in range(8)]
    for e in ref.timeline:
        starts[e.rank].append(e.start)
    start = {(r, k): t for r in range(8) for k, t in enumerate(starts[r])}
    end_of: dict = {}
    for e in ref.timeline:
        end_of[(e.op if e.op != "FB" else "F", e.chain, e.stage, e.mb)] = e.end
        if e.pair:
            end_of[("B" if e.pair[0] == "BW" else e.pair[0], *e.pair[1:])] = e.end
    for e in ref.timeline:
        if e.op == "BW":
            end_of[("B", e.chain, e.stage, e.mb)] = e.end
    prefetched = 0
    for r, prog in enumerate(p.ranks):
        k = 0  # index of the next compute op
        for ins in prog:
            if type(ins) is not CommBatch:
                k += 1
                continue
            for c in ins.ops:
                if not c.kind.startswith("RECV"):
                    continue
                producer = (("F", c.chain, c.stage - 1, c.mb) if c.kind == "RECV_F"
                            else ("B", c.chain, c.stage + 1, c.mb))
                t = end_of[producer]
                assert k == 0 or start[(r, k - 1)] < t  # cannot move before the previous op
                assert (r, k) not in start or start[(r, k)] >= t  # the next op starts after the transfer
                consumer_index = next(j for j, item in enumerate(p.compute_ops(r))
                                      for op in ((item.f, item.b) if type(item) is FB else (item,))
                                      if (op.chain, op.stage, op.mb) == (c.chain, c.stage, c.mb)
                                      and (op.kind == "F") == (c.kind == "RECV_F"))
                prefetched += consumer_index > k
    assert prefetched > 0


def test_broken_program_order_is_a_deadlock() -> None:
    s = build_schedule("dualpipe", 2, 4)
    p = lower(s)
    # move rank 0's first receive batch after the op that consumes it
    prog = p.ranks[1]
    i = next(i for i, ins in enumerate(prog) if type(ins) is CommBatch and ins.ops[0].kind == "RECV_F")
    prog[i], prog[i + 1] = prog[i + 1], prog[i]
    with pytest.raises(ScheduleError, match="receive is not posted before it"):
        validate_program(p)


def test_crossed_channel_order_is_caught() -> None:
    p = lower(build_schedule("gpipe", 2, 4))
    prog = p.ranks[1]
    idx = [i for i, ins in enumerate(prog) if type(ins) is CommBatch and ins.ops[0].kind == "RECV_F"]
    first, second = prog[idx[0]], prog[idx[1]]
    # post both receives up front, in crossed order: m1 first, then m0
    prog[idx[0]] = CommBatch(second.ops + first.ops)
    del prog[idx[1]]
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1: send #0 carries .* must pair up in order"):
        validate_program(p)


def test_rendezvous_deadlock_detected() -> None:
    """Each rank posts a lone receive from the other before its send: fine for buffered sends,
    a deadlock under rendezvous semantics (each comm stream is stuck on its receive)."""
    F0, F1, B0, B1 = Op("F", 0, 0, 0), Op("F", 1, 1, 1), Op("BW", 1, 1, 1), Op("BW", 0, 0, 0)
    G0, G1, C0, C1 = Op("F", 1, 0, 1), Op("F", 0, 1, 0), Op("BW", 0, 1, 0), Op("BW", 1, 0, 1)
    sched = Schedule("hand", 2, 2, ((0, 1), (1, 0)), (0, 1), [[F0, F1, B0, B1], [G0, G1, C0, C1]])
    validate(sched)
    prog = Program(sched, [
        [CommBatch((Comm("RECV_F", 1, 1, 1, 1),)), F0, CommBatch((Comm("SEND_F", 1, 0, 0, 0),)), F1, B0,
         CommBatch((Comm("SEND_B", 1, 1, 1, 1),)), CommBatch((Comm("RECV_B", 1, 0, 0, 0),)), B1],
        [CommBatch((Comm("RECV_F", 0, 0, 1, 0),)), G0, CommBatch((Comm("SEND_F", 0, 1, 0, 1),)), G1, C0,
         CommBatch((Comm("SEND_B", 0, 0, 1, 0),)), CommBatch((Comm("RECV_B", 0, 1, 0, 1),)), C1],
    ])
    with pytest.raises(ScheduleError, match="deadlock under rendezvous point-to-point semantics") as exc:
        validate_program(prog)
    assert ("rank 0 instruction 3 F(c1,s1,m1) waits for comm batch 0 (the receive of F(c1,s0,m1) from rank 1) "
            "to complete") in str(exc.value)
    # the lowered program of the same schedule is fine
    validate_program(lower(sched))
