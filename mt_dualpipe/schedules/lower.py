"""Lowering: insert the point-to-point communication a schedule needs.

Every cross-rank dependency becomes a SEND on the producing rank and a RECV on the consuming rank.
To be deadlock-free under rendezvous semantics (NCCL/MCCL: a transfer completes only when both
sides have posted it, and a rank's batches complete in the order posted) all ranks post their
transfers in one global order. We take that order from a reference execution — the schedule
simulated with unit costs — and key each transfer by (producer's end time, producer rank,
producer index, part):

* a send is posted right after the op that produces it;
* a receive is posted as early as that order allows: right after the last local op that starts
  before its producer ends. Everything after that point starts later than the transfer, so a
  compute op never waits on a transfer that is ordered after itself.

Ops posted at the same point form one ``CommBatch`` (one ``batch_isend_irecv``), in key order.
"""

from __future__ import annotations

from bisect import bisect_left

from ._perf import gc_paused
from .costs import Costs
from .data_parallel import add_grad_reduction
from .ir import FB, Comm, CommBatch, Instruction, Program, Schedule
from .ops import RULES, SEND_RECV
from .simulate import run_schedule
from .validate import check_structure


def _routes(placement: tuple[tuple[int, ...], ...]) -> dict[str, list[tuple | None]]:
    """Per kind, per ``c * S + s``: where the op's signal goes when it leaves the rank.

    (peer rank, send kind, receive kind, consumer stage), or None when the op makes no signal or
    its consumer runs on the same rank — all from ``ops`` (what a kind makes, where it travels).
    """
    S = len(placement[0])
    out: dict[str, list[tuple | None]] = {}
    for kind, rule in RULES.items():
        row: list[tuple | None] = []
        for chain in placement:
            for s in range(S):
                t = s + rule.sends_to
                if rule.makes is None or not rule.sends_to or not 0 <= t < S or chain[t] == chain[s]:
                    row.append(None)
                else:
                    send_kind, recv_kind = SEND_RECV[rule.makes]
                    row.append((chain[t], send_kind, recv_kind, t))
        out[kind] = row
    return out


@gc_paused
def lower(schedule: Schedule, check: bool = True, data_parallel: bool = False) -> Program:
    """Lower ``schedule`` into a ``Program`` with SEND_F/RECV_F/SEND_B/RECV_B batches.

    With ``check`` (the default) the schedule's structure is validated first; the reference
    execution itself proves the compute order deadlock-free (it raises ``ScheduleError`` if not).
    ``data_parallel`` first applies ``data_parallel.add_grad_reduction``: one ``REDUCE_GRAD`` per
    stage right after its last weight-gradient op.
    """
    if data_parallel:
        schedule = add_grad_reduction(schedule)
    if check:
        check_structure(schedule)
    P = schedule.num_ranks
    placement = schedule.placement
    starts: list[list[float]] = [[] for _ in range(P)]
    ends: list[list[float]] = [[] for _ in range(P)]
    run_schedule(schedule, Costs(1.0, 1.0, 1.0), record=False, starts_out=starts, ends_out=ends)

    routes = _routes(placement)

    # one entry per transfer: (end of its producer, producer rank, index, part, send, recv, peer)
    transfers: list[tuple] = []
    append = transfers.append
    new = tuple.__new__  # builds the named tuples without their Python-level __new__ (twice as fast)
    S = len(placement[0])
    for r, ops in enumerate(schedule.ranks):
        ends_r = ends[r]
        for i, item in enumerate(ops):
            parts = (item.f, item.b) if type(item) is FB else (item,)
            for part_no, (kind, c, s, m) in enumerate(parts):
                route = routes[kind][c * S + s]
                if route is not None:
                    peer, send_kind, recv_kind, t = route
                    append((ends_r[i], r, i, part_no, new(Comm, (send_kind, peer, c, s, m)),
                            new(Comm, (recv_kind, r, c, t, m)), peer))
    transfers.sort()  # (end, rank, index, part) is unique: the Comm fields are never compared

    # slots[r][j]: comm ops posted right before rank r's op j (j == len: after the last op)
    slots: list[dict[int, list[Comm]]] = [{} for _ in range(P)]
    for t, r, i, _, send, recv, peer in transfers:
        slots[r].setdefault(i + 1, []).append(send)
        slots[peer].setdefault(bisect_left(starts[peer], t), []).append(recv)

    ranks: list[list[Instruction]] = []
    for r, ops in enumerate(schedule.ranks):
        rank_slots = slots[r]
        out: list[Instruction] = []
        prev = 0
        for j in sorted(rank_slots):
            out.extend(ops[prev:j])
            out.append(new(CommBatch, (tuple(rank_slots[j]),)))
            prev = j
        out.extend(ops[prev:])
        ranks.append(out)
    return Program(schedule, ranks)
