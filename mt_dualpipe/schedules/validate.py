"""Checks that a schedule (or a lowered program) can run: right ops, right ranks, no deadlock.

``validate(schedule)`` checks that every (chain, stage, micro-batch) has exactly one F and either
one B and one W or one BW, each on the rank the placement names, that FB pairs are well formed,
and then walks the dependencies (the simulator's walk) to prove the order can complete. Every
failure raises ``ScheduleError`` naming the rank, the op index, the op and what it waits for; a
deadlock names the cycle of waiting ranks.

``validate_program(program)`` additionally checks the communication: each cross-rank dependency
has exactly one send and one matching receive, sends and receives pair up in order per channel,
sends come after their producer and receives before their consumer, and the program completes
under rendezvous point-to-point semantics (each rank's comm batches complete in the order posted,
an op completes only when the peer's batch holding its match is active, and a compute op waits
for the batches holding its receives) — the NCCL/MCCL model.
"""

from __future__ import annotations

from .errors import ScheduleError
from .ir import FB, CommBatch, Op, Program, Schedule
from .simulate import run_schedule


def _check_structure(schedule: Schedule) -> None:
    P, M = schedule.num_ranks, schedule.num_microbatches
    placement = schedule.placement
    if not placement or any(len(c) == 0 for c in placement):
        raise ScheduleError("placement must list at least one stage for every chain")
    for c, chain in enumerate(placement):
        for s, r in enumerate(chain):
            if not 0 <= r < P:
                raise ScheduleError(f"placement of chain {c} stage {s} is rank {r}; ranks are 0..{P - 1}")
    for m, c in enumerate(schedule.microbatch_chain):
        if not 0 <= c < len(placement):
            raise ScheduleError(f"micro-batch {m} is on chain {c}; chains are 0..{len(placement) - 1}")

    seen: dict[tuple[str, int, int, int], tuple[int, int]] = {}
    chain_of = schedule.microbatch_chain
    for r, ops in enumerate(schedule.ranks):
        for i, item in enumerate(ops):
            if type(item) is FB:
                if item.f.kind != "F" or item.b.kind not in ("B", "BW"):
                    raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs an F with a B or BW")
                if item.f.mb == item.b.mb:
                    raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs two different micro-batches")
                parts = (item.f, item.b)
            elif type(item) is Op:
                parts = (item,)
            else:
                raise ScheduleError(f"rank {r} op {i}: expected an Op or FB, got {item!r}")
            for op in parts:
                where = f"rank {r} op {i} {op}"
                if op.kind not in ("F", "B", "W", "BW"):
                    raise ScheduleError(f"{where}: unknown kind {op.kind!r}; allowed F, B, W, BW, FB")
                if not 0 <= op.chain < len(placement) or not 0 <= op.stage < len(placement[op.chain]):
                    raise ScheduleError(f"{where}: no such chain/stage in the placement")
                if not 0 <= op.mb < M:
                    raise ScheduleError(f"{where}: micro-batch {op.mb} out of range 0..{M - 1}")
                if chain_of[op.mb] != op.chain:
                    raise ScheduleError(f"{where}: micro-batch {op.mb} belongs to chain {chain_of[op.mb]}")
                owner = placement[op.chain][op.stage]
                if owner != r:
                    raise ScheduleError(
                        f"{where}: the placement puts chain {op.chain} stage {op.stage} on rank {owner}")
                key = (op.kind, op.chain, op.stage, op.mb)
                if key in seen:
                    pr, pi = seen[key]
                    raise ScheduleError(f"{where}: duplicate, already at rank {pr} op {pi}")
                seen[key] = (r, i)

    for m, c in enumerate(chain_of):
        for s in range(len(placement[c])):
            r = placement[c][s]
            has = [k for k in ("F", "B", "W", "BW") if (k, c, s, m) in seen]
            if "F" not in has:
                raise ScheduleError(f"rank {r}: F(c{c},s{s},m{m}) is missing")
            if "BW" in has and ("B" in has or "W" in has):
                raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) has both a BW and a split B/W")
            if "BW" not in has and not ("B" in has and "W" in has):
                missing = "a BW, or a B and a W" if not ("B" in has or "W" in has) else ("W" if "B" in has else "B")
                raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) lacks {missing}")


def validate(schedule: Schedule | Program) -> None:
    """Raise ScheduleError if ``schedule`` (or a program's compute ops) cannot run; else return None."""
    if isinstance(schedule, Program):
        validate_program(schedule)
        return
    _check_structure(schedule)
    run_schedule(schedule, record=False)  # raises on deadlock, naming the waiting ops


def _compute_view(program: Program) -> Schedule:
    s = program.schedule
    return Schedule(s.name, s.num_ranks, s.num_microbatches, s.placement, s.microbatch_chain,
                    [program.compute_ops(r) for r in range(s.num_ranks)], s.meta)


def _match_key(c: Op | object) -> tuple:
    """The dependency a comm op carries: (kind of data, chain, producing stage, mb)."""
    kind, chain, stage, mb = c.kind, c.chain, c.stage, c.mb
    if kind == "SEND_F":
        return ("F", chain, stage, mb)
    if kind == "RECV_F":
        return ("F", chain, stage - 1, mb)
    if kind == "SEND_B":
        return ("B", chain, stage, mb)
    return ("B", chain, stage + 1, mb)


def _bad_comm(r: int, i: int, cm, chain, nxt: int, key: tuple, expected: set, book: set) -> str:
    """The message for a comm op that is on the wrong rank, talks to the wrong peer or repeats."""
    loc = f"rank {r} instruction {i} {cm}"
    if not 0 <= cm.stage < len(chain) or chain[cm.stage] != r:
        return f"{loc}: rank {r} does not run chain {cm.chain} stage {cm.stage}"
    if not 0 <= nxt < len(chain):
        return f"{loc}: there is no stage {nxt} to talk to"
    if chain[nxt] != cm.peer:
        return f"{loc}: peer should be rank {chain[nxt]} (stage {nxt})"
    if key not in expected:
        return f"{loc}: no such cross-rank dependency"
    return f"{loc}: duplicate {'send' if cm.kind.startswith('SEND') else 'receive'}"


def validate_program(program: Program) -> None:
    """Validate a lowered program: compute ops, send/recv matching, and rendezvous deadlock-freedom."""
    sched = _compute_view(program)
    validate(sched)
    placement = sched.placement

    # --- every comm op is on the right rank and talks to the right peer ------------------------
    expected: set[tuple] = set()
    for c, chain in enumerate(placement):
        for m in sched.microbatches_of(c):
            for s in range(len(chain) - 1):
                if chain[s] != chain[s + 1]:
                    expected.add(("F", c, s, m))
                    expected.add(("B", c, s + 1, m))
    channels: dict[tuple[int, int], tuple[list, list]] = {}
    sends_seen: set[tuple] = set()
    recvs_seen: set[tuple] = set()
    for r, prog in enumerate(program.ranks):
        for i, ins in enumerate(prog):
            if type(ins) is not CommBatch:
                continue
            if not ins.ops:
                raise ScheduleError(f"rank {r} instruction {i}: empty comm batch")
            for cm in ins.ops:
                kind = cm.kind
                is_send = kind == "SEND_F" or kind == "SEND_B"
                if not is_send and kind != "RECV_F" and kind != "RECV_B":
                    raise ScheduleError(f"rank {r} instruction {i} {cm}: unknown comm kind; "
                                        "allowed SEND_F, RECV_F, SEND_B, RECV_B")
                chain = placement[cm.chain]
                nxt = cm.stage + (1 if kind in ("SEND_F", "RECV_B") else -1)
                key = _match_key(cm)
                book = sends_seen if is_send else recvs_seen
                if not 0 <= cm.stage < len(chain) or chain[cm.stage] != r or not 0 <= nxt < len(chain) \
                        or chain[nxt] != cm.peer or key not in expected or key in book:
                    raise ScheduleError(_bad_comm(r, i, cm, chain, nxt, key, expected, book))
                book.add(key)
                src, dst = (r, cm.peer) if is_send else (cm.peer, r)
                channels.setdefault((src, dst), ([], []))[0 if is_send else 1].append(key)
    for key in sorted(expected - sends_seen):
        raise ScheduleError(f"no send for {key[0]}(c{key[1]},s{key[2]},m{key[3]}) to the next rank")
    for key in sorted(expected - recvs_seen):
        raise ScheduleError(f"no receive for {key[0]}(c{key[1]},s{key[2]},m{key[3]}) from the previous rank")
    for (src, dst), (sends, recvs) in channels.items():
        for k, (a, b) in enumerate(zip(sends, recvs)):
            if a != b:
                raise ScheduleError(
                    f"channel rank {src} -> rank {dst}: send #{k} carries {a} but receive #{k} expects {b}; "
                    "sends and receives must pair up in order"
                )

    # --- sends after their producer, receives before their consumer ----------------------------
    for r, prog in enumerate(program.ranks):
        produced: set[tuple] = set()
        received: set[tuple] = set()
        for i, ins in enumerate(prog):
            if type(ins) is CommBatch:
                for cm in ins.ops:
                    key = _match_key(cm)
                    if cm.kind.startswith("SEND"):
                        if key not in produced:
                            raise ScheduleError(f"rank {r} instruction {i} {cm}: sent before it is computed")
                    else:
                        received.add(key)
                continue
            for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                if op.kind == "F":
                    produced.add(("F", op.chain, op.stage, op.mb))
                    need = ("F", op.chain, op.stage - 1, op.mb)
                elif op.kind in ("B", "BW"):
                    produced.add(("B", op.chain, op.stage, op.mb))
                    need = ("B", op.chain, op.stage + 1, op.mb)
                else:
                    continue
                if need in expected and need not in received:
                    raise ScheduleError(
                        f"rank {r} instruction {i} {op}: needs {need} but its receive is not posted before it")

    _rendezvous_check(program)


def _rendezvous_check(program: Program) -> None:
    """Run the program under rendezvous semantics; raise ScheduleError naming the stuck ranks."""
    P = program.num_ranks
    progs = program.ranks
    batches: list[list[CommBatch]] = [[ins for ins in prog if type(ins) is CommBatch] for prog in progs]
    # where each op's match lives: (rank, batch index, op index)
    loc: dict[tuple, tuple[int, int, int]] = {}
    for r in range(P):
        for b, batch in enumerate(batches[r]):
            for j, cm in enumerate(batch.ops):
                loc[(cm.kind.startswith("SEND"), _match_key(cm))] = (r, b, j)
    partner: list[list[list[tuple[int, int, int]]]] = [
        [[loc[(not cm.kind.startswith("SEND"), _match_key(cm))] for cm in batch.ops] for batch in batches[r]]
        for r in range(P)
    ]
    pending = [[len(batch.ops) for batch in batches[r]] for r in range(P)]
    done = [[[False] * len(batch.ops) for batch in batches[r]] for r in range(P)]
    # per compute instruction, the highest batch index holding a receive it consumes (-1: none)
    wait_for: list[list[int]] = []
    for prog in progs:
        recv_batch: dict[tuple, int] = {}
        nb = 0
        w = []
        for ins in prog:
            if type(ins) is CommBatch:
                for cm in ins.ops:
                    if not cm.kind.startswith("SEND"):
                        recv_batch[_match_key(cm)] = nb
                nb += 1
                w.append(-1)
                continue
            need = -1
            for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                if op.kind == "F":
                    k = ("F", op.chain, op.stage - 1, op.mb)
                elif op.kind in ("B", "BW"):
                    k = ("B", op.chain, op.stage + 1, op.mb)
                else:
                    continue
                need = max(need, recv_batch.get(k, -1))
            w.append(need)
        wait_for.append(w)

    head = [0] * P
    posted = [0] * P
    pc = [0] * P
    ranks_to_run = list(range(P))
    heads_to_check: list[int] = []

    while ranks_to_run or heads_to_check:
        while ranks_to_run:
            r = ranks_to_run.pop()
            prog, w = progs[r], wait_for[r]
            i = pc[r]
            while i < len(prog):
                if type(prog[i]) is CommBatch:
                    posted[r] += 1
                    if posted[r] - 1 == head[r]:
                        heads_to_check.append(r)
                elif w[i] >= head[r]:
                    break
                i += 1
            pc[r] = i
        while heads_to_check:
            r = heads_to_check.pop()
            b = head[r]
            if b >= posted[r]:
                continue
            for j, (r2, b2, j2) in enumerate(partner[r][b]):
                if done[r][b][j] or b2 != head[r2] or b2 >= posted[r2]:
                    continue
                done[r][b][j] = done[r2][b2][j2] = True
                pending[r][b] -= 1
                pending[r2][b2] -= 1
                if pending[r2][b2] == 0 and r2 != r:
                    head[r2] += 1
                    heads_to_check.append(r2)
                    ranks_to_run.append(r2)
            if pending[r][b] == 0 and head[r] == b:
                head[r] += 1
                heads_to_check.append(r)
                ranks_to_run.append(r)

    stuck = [r for r in range(P) if pc[r] < len(progs[r]) or head[r] < len(batches[r])]
    if stuck:
        lines = []
        for r in stuck:
            if pc[r] < len(progs[r]):
                b = wait_for[r][pc[r]]
                peers = sorted({cm.peer for cm in batches[r][b].ops}) if 0 <= b < len(batches[r]) else []
                lines.append(f"rank {r} instruction {pc[r]} {progs[r][pc[r]]} waits for comm batch {b} "
                             f"(peers {peers}) to complete")
            else:
                b = head[r]
                lines.append(f"rank {r} comm batch {b} {batches[r][b]} never completes")
        raise ScheduleError("deadlock under rendezvous point-to-point semantics:\n  " + "\n  ".join(lines))
