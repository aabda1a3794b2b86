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

Ops posted at the same point form one ``CommBatch`` (one ``batch_isend_irecv``).
"""

from __future__ import annotations

from bisect import bisect_left

from .costs import Costs
from .ir import FB, Comm, CommBatch, Instruction, Program, Schedule
from .simulate import run_schedule
from .validate import _check_structure


def lower(schedule: Schedule, check: bool = True) -> Program:
    """Lower ``schedule`` into a ``Program`` with SEND_F/RECV_F/SEND_B/RECV_B batches.

    The schedule is validated first (a bad schedule raises ``ScheduleError``). With ``check`` the
    structure is checked; the reference execution itself proves the compute order deadlock-free.
    """
    if check:
        _check_structure(schedule)
    P = schedule.num_ranks
    placement = schedule.placement
    ref = run_schedule(schedule, Costs(1.0, 1.0, 1.0), record=True)  # raises on deadlock
    starts: list[list[float]] = [[] for _ in range(P)]
    ends: list[list[float]] = [[] for _ in range(P)]
    for ev in ref.timeline:
        starts[ev.rank].append(ev.start)
        ends[ev.rank].append(ev.end)

    # slots[r]: {position before which the batch is posted: [(key, Comm), ...]}
    slots: list[dict[int, list[tuple[tuple, Comm]]]] = [{} for _ in range(P)]
    for r, ops in enumerate(schedule.ranks):
        for i, item in enumerate(ops):
            parts = (item.f, item.b) if type(item) is FB else (item,)
            for part_no, op in enumerate(parts):
                c, s, m = op.chain, op.stage, op.mb
                chain = placement[c]
                if op.kind == "F" and s + 1 < len(chain) and chain[s + 1] != r:
                    peer = chain[s + 1]
                    send, recv = Comm("SEND_F", peer, c, s, m), Comm("RECV_F", r, c, s + 1, m)
                elif op.kind in ("B", "BW") and s > 0 and chain[s - 1] != r:
                    peer = chain[s - 1]
                    send, recv = Comm("SEND_B", peer, c, s, m), Comm("RECV_B", r, c, s - 1, m)
                else:
                    continue
                t = ends[r][i]
                key = (t, r, i, part_no)
                slots[r].setdefault(i + 1, []).append((key, send))
                slots[peer].setdefault(bisect_left(starts[peer], t), []).append((key, recv))

    ranks: list[list[Instruction]] = []
    for r, ops in enumerate(schedule.ranks):
        out: list[Instruction] = []
        rank_slots = slots[r]
        for i in range(len(ops) + 1):
            batch = rank_slots.get(i)
            if batch:
                batch.sort(key=lambda kc: kc[0])
                out.append(CommBatch(tuple(cm for _, cm in batch)))
            if i < len(ops):
                out.append(ops[i])
        ranks.append(out)
    return Program(schedule, ranks)
