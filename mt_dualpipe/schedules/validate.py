"""Checks that a schedule (or a lowered program) can run: right ops, right ranks, no deadlock.

``validate(schedule)`` checks that every (chain, stage, micro-batch) has exactly one F and either
one B and one W or one BW, each on the rank the placement names, that FB pairs are well formed,
and then walks the dependencies (the simulator's walk) to prove the order can complete. Every
failure raises ``ScheduleError`` naming the rank, the op index, the op and what it waits for; a
deadlock names the cycle of waiting ranks.

``validate_program(program)`` checks the communication too: each cross-rank dependency has
exactly one send and one matching receive, they pair up in order per channel, sends come after
their producer and receives before their consumer, and the program completes under rendezvous
point-to-point semantics — the NCCL/MCCL model: each rank's comm batches complete in the order
posted, a transfer completes only when the batches holding both of its ends are active (at the
head of their rank's queue), and a compute op waits for the batches holding its receives.

Internally ops are numbered ``u = (chain * S + stage) * M + mb`` (S: stages per chain), and the
data a transfer carries is ``2u`` (F's output) or ``2u + 1`` (B's input-gradient): flat arrays
instead of dictionaries keep this linear and fast at 64 ranks x 1024 micro-batches.
"""

from __future__ import annotations

from ._perf import gc_paused
from .errors import ScheduleError
from .ir import FB, CommBatch, Op, Program, Schedule
from .simulate import run_schedule

_KINDS = ("F", "B", "W", "BW")


def _check_header(schedule: Schedule) -> None:
    P = schedule.num_ranks
    placement = schedule.placement
    if not placement or any(len(c) == 0 for c in placement):
        raise ScheduleError("placement must list at least one stage for every chain")
    if len({len(c) for c in placement}) != 1:
        raise ScheduleError("all chains of a schedule must have the same number of stages")
    for c, chain in enumerate(placement):
        for s, r in enumerate(chain):
            if not 0 <= r < P:
                raise ScheduleError(f"placement of chain {c} stage {s} is rank {r}; ranks are 0..{P - 1}")
    for m, c in enumerate(schedule.microbatch_chain):
        if not 0 <= c < len(placement):
            raise ScheduleError(f"micro-batch {m} is on chain {c}; chains are 0..{len(placement) - 1}")


def check_structure(schedule: Schedule) -> None:
    """Exactly-once ops on the placement's ranks, well-formed FB pairs (no dependency check)."""
    _check_header(schedule)
    M = schedule.num_microbatches
    placement = schedule.placement
    C, S = len(placement), len(placement[0])
    n = C * S * M
    seen = {k: bytearray(n) for k in _KINDS}
    chain_of = schedule.microbatch_chain
    for r, ops in enumerate(schedule.ranks):
        for i, item in enumerate(ops):
            t = type(item)
            if t is FB:
                f, b = item.f, item.b
                if type(f) is not Op or type(b) is not Op or f.kind != "F" or b.kind not in ("B", "BW"):
                    raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs an F with a B or BW")
                if f.mb == b.mb:
                    raise ScheduleError(f"rank {r} op {i} {item}: an FB pairs two different micro-batches")
                parts = (f, b)
            elif t is Op:
                parts = (item,)
            else:
                raise ScheduleError(f"rank {r} op {i}: expected an Op or FB, got {item!r}")
            for op in parts:
                kind, c, s, m = op
                arr = seen.get(kind)
                if arr is None:
                    raise ScheduleError(f"rank {r} op {i} {op}: unknown kind {kind!r}; allowed F, B, W, BW, FB")
                if not (0 <= c < C and 0 <= s < S and 0 <= m < M) or chain_of[m] != c or placement[c][s] != r:
                    raise ScheduleError(_misplaced(r, i, op, schedule))
                u = (c * S + s) * M + m
                if arr[u]:
                    raise ScheduleError(f"rank {r} op {i} {op}: duplicate, {_where(schedule, op)}")
                arr[u] = 1
    sf, sb, sw, sbw = seen["F"], seen["B"], seen["W"], seen["BW"]
    for m, c in enumerate(chain_of):
        for s in range(S):
            u = (c * S + s) * M + m
            if sf[u] and ((sbw[u] and not sb[u] and not sw[u]) or (sb[u] and sw[u] and not sbw[u])):
                continue
            r = placement[c][s]
            if not sf[u]:
                raise ScheduleError(f"rank {r}: F(c{c},s{s},m{m}) is missing")
            if sbw[u]:
                raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) has both a BW and a split B/W")
            missing = "a BW, or a B and a W" if not (sb[u] or sw[u]) else ("W" if sb[u] else "B")
            raise ScheduleError(f"rank {r}: (c{c},s{s},m{m}) lacks {missing}")


def _misplaced(r: int, i: int, op: Op, schedule: Schedule) -> str:
    where = f"rank {r} op {i} {op}"
    placement, M = schedule.placement, schedule.num_microbatches
    if not 0 <= op.chain < len(placement) or not 0 <= op.stage < len(placement[op.chain]):
        return f"{where}: no such chain/stage in the placement"
    if not 0 <= op.mb < M:
        return f"{where}: micro-batch {op.mb} out of range 0..{M - 1}"
    if schedule.microbatch_chain[op.mb] != op.chain:
        return f"{where}: micro-batch {op.mb} belongs to chain {schedule.microbatch_chain[op.mb]}"
    owner = placement[op.chain][op.stage]
    return f"{where}: the placement puts chain {op.chain} stage {op.stage} on rank {owner}"


def _where(schedule: Schedule, op: Op) -> str:
    for r, ops in enumerate(schedule.ranks):
        for i, item in enumerate(ops):
            if op in ((item.f, item.b) if type(item) is FB else (item,)):
                return f"already at rank {r} op {i}"
    return "already present"


@gc_paused
def validate(schedule: Schedule | Program) -> None:
    """Raise ScheduleError if ``schedule`` (or a program) cannot run; else return None."""
    if isinstance(schedule, Program):
        validate_program(schedule)
        return
    check_structure(schedule)
    run_schedule(schedule, record=False)  # raises on deadlock, naming the waiting ops


def _data_name(key: int, S: int, M: int) -> str:
    u, is_b = divmod(key, 2)
    cs, m = divmod(u, M)
    c, s = divmod(cs, S)
    return f"{'B' if is_b else 'F'}(c{c},s{s},m{m})"


@gc_paused
def validate_program(program: Program) -> None:
    """Validate a lowered program: compute ops, send/recv matching, and rendezvous deadlock-freedom."""
    view = program.compute_schedule()
    check_structure(view)
    P, M = view.num_ranks, view.num_microbatches
    placement = view.placement
    S = len(placement[0])
    nkeys = 2 * len(placement) * S * M
    progs = program.ranks

    # ---- pass 1: every comm op on the right rank, right peer, once; channel order -------------
    send_batch = [-1] * nkeys  # batch index (on the producing rank) holding each send
    recv_batch = [-1] * nkeys
    batch_keys: list[list[list[tuple[int, int, bool]]]] = []  # per rank, per batch: (key, peer, is send)
    # per channel src * P + dst: the keys sent, the keys received, in program order
    channels: list[tuple[list[int], list[int]]] = [([], []) for _ in range(P * P)]
    # comm kind -> (offset of the producing stage, offset of the peer's stage, data bit, is a send)
    shapes = {"SEND_F": (0, 1, 0, True), "RECV_F": (-1, -1, 0, False),
              "SEND_B": (0, -1, 1, True), "RECV_B": (1, 1, 1, False)}
    chain_of = view.microbatch_chain
    C = len(placement)
    for r, prog in enumerate(progs):
        keys_r: list[list[tuple[int, int, bool]]] = []
        for i, ins in enumerate(prog):
            if type(ins) is not CommBatch:
                continue
            if not ins.ops:
                raise ScheduleError(f"rank {r} instruction {i}: empty comm batch")
            b = len(keys_r)
            keys: list[tuple[int, int, bool]] = []
            for cm in ins.ops:
                kind, peer, c, s, m = cm
                shape = shapes.get(kind)
                if shape is None:
                    raise ScheduleError(f"rank {r} instruction {i} {cm}: unknown comm kind; "
                                        "allowed SEND_F, RECV_F, SEND_B, RECV_B")
                dps, dnx, bit, is_send = shape
                nxt = s + dnx
                if not (0 <= c < C and 0 <= s < S and 0 <= nxt < S and 0 <= m < M) \
                        or placement[c][s] != r or placement[c][nxt] != peer or peer == r or chain_of[m] != c:
                    raise ScheduleError(_bad_comm(r, i, cm, placement, chain_of, S, M))
                key = 2 * ((c * S + s + dps) * M + m) + bit
                if is_send:
                    if send_batch[key] >= 0:
                        raise ScheduleError(f"rank {r} instruction {i} {cm}: duplicate send")
                    send_batch[key] = b
                    channels[r * P + peer][0].append(key)
                else:
                    if recv_batch[key] >= 0:
                        raise ScheduleError(f"rank {r} instruction {i} {cm}: duplicate receive")
                    recv_batch[key] = b
                    channels[peer * P + r][1].append(key)
                keys.append((key, peer, is_send))
            keys_r.append(keys)
        batch_keys.append(keys_r)

    # every cross-rank edge has both ends
    for c, chain in enumerate(placement):
        for m in range(M):
            if view.microbatch_chain[m] != c:
                continue
            for s in range(S - 1):
                if chain[s] == chain[s + 1]:
                    continue
                for key in (2 * ((c * S + s) * M + m), 2 * ((c * S + s + 1) * M + m) + 1):
                    if send_batch[key] < 0:
                        raise ScheduleError(f"no send for {_data_name(key, S, M)} to rank "
                                            f"{chain[s + 1] if key % 2 == 0 else chain[s]}")
                    if recv_batch[key] < 0:
                        raise ScheduleError(f"no receive for {_data_name(key, S, M)} on rank "
                                            f"{chain[s + 1] if key % 2 == 0 else chain[s]}")
    for ch, (sends, recvs) in enumerate(channels):
        if sends != recvs:
            k = next((k for k, (a, b) in enumerate(zip(sends, recvs)) if a != b), min(len(sends), len(recvs)))
            if k == min(len(sends), len(recvs)):
                src, dst = divmod(ch, P)
                raise ScheduleError(f"channel rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")
            src, dst = divmod(ch, P)
            raise ScheduleError(
                f"channel rank {src} -> rank {dst}: send #{k} carries {_data_name(sends[k], S, M)} but receive "
                f"#{k} expects {_data_name(recvs[k], S, M)}; sends and receives must pair up in order")

    _rendezvous_run(program, view, batch_keys, send_batch, recv_batch, nkeys)


def _bad_comm(r: int, i: int, cm, placement, chain_of, S: int, M: int) -> str:
    """The message for a comm op that is on the wrong rank or talks to the wrong peer."""
    loc = f"rank {r} instruction {i} {cm}"
    if not 0 <= cm.chain < len(placement) or not 0 <= cm.stage < S or not 0 <= cm.mb < M:
        return f"{loc}: no such chain/stage/micro-batch"
    if chain_of[cm.mb] != cm.chain:
        return f"{loc}: micro-batch {cm.mb} belongs to chain {chain_of[cm.mb]}"
    chain = placement[cm.chain]
    if chain[cm.stage] != r:
        return f"{loc}: rank {r} does not run chain {cm.chain} stage {cm.stage}"
    nxt = cm.stage + (1 if cm.kind in ("SEND_F", "RECV_B") else -1)
    if not 0 <= nxt < S:
        return f"{loc}: there is no stage {nxt} to talk to"
    return f"{loc}: peer should be rank {chain[nxt]} (stage {nxt})"


def _rendezvous_run(program: Program, view: Schedule, batch_keys, send_batch, recv_batch, nkeys: int) -> None:
    """Execute the program under rendezvous semantics, checking data order on the way."""
    P, M = view.num_ranks, view.num_microbatches
    placement = view.placement
    S = len(placement[0])
    progs = program.ranks
    done = bytearray(nkeys)  # data produced (F output / B input-grad), by its key
    w_ready = bytearray(nkeys // 2)  # B done locally (W may run)
    paired = bytearray(nkeys)  # transfer completed
    posted_recv = bytearray(nkeys)
    pending = [[len(k) for k in kr] for kr in batch_keys]
    head = [0] * P
    posted = [0] * P
    pc = [0] * P
    stuck_on: dict[int, tuple[int, int]] = {}
    ranks_to_run = list(range(P))
    heads: list[int] = []

    def fail(r: int, i: int, what: str) -> None:
        raise ScheduleError(f"rank {r} instruction {i} {progs[r][i]}: {what}")

    while ranks_to_run or heads:
        while ranks_to_run:
            r = ranks_to_run.pop()
            prog = progs[r]
            i = pc[r]
            n = len(prog)
            h = head[r]
            while i < n:
                ins = prog[i]
                if type(ins) is CommBatch:
                    b = posted[r]
                    for key, _, is_send in batch_keys[r][b]:
                        if is_send:
                            if not done[key]:
                                fail(r, i, f"sends {_data_name(key, S, M)} before it is computed")
                        else:
                            posted_recv[key] = 1
                    posted[r] = b + 1
                    if b == h:
                        heads.append(r)
                    i += 1
                    continue
                blocked = False
                for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                    kind, c, s, m = op
                    u = (c * S + s) * M + m
                    chain = placement[c]
                    if kind == "W":
                        if not w_ready[u]:
                            fail(r, i, f"waits for B(c{c},s{s},m{m}), which rank {r} runs later or never")
                        continue
                    if kind == "F":
                        if s == 0:
                            continue
                        key, other = 2 * (u - M), chain[s - 1]
                    else:
                        if not done[2 * u]:
                            fail(r, i, f"waits for F(c{c},s{s},m{m}), which rank {r} runs later or never")
                        if s + 1 == S:
                            continue
                        key, other = 2 * (u + M) + 1, chain[s + 1]
                    if other == r:
                        if not done[key]:
                            fail(r, i, f"waits for {_data_name(key, S, M)}, which rank {r} runs later or never")
                    elif not posted_recv[key]:
                        fail(r, i, f"needs {_data_name(key, S, M)} but its receive is not posted before it")
                    elif recv_batch[key] >= h:
                        blocked = True
                        stuck_on[r] = (key, other)  # formatted only if the run ends stuck
                        break
                if blocked:
                    break
                for op in ((ins.f, ins.b) if type(ins) is FB else (ins,)):
                    kind, c, s, m = op
                    u = (c * S + s) * M + m
                    if kind == "F":
                        done[2 * u] = 1
                    elif kind != "W":
                        done[2 * u + 1] = 1
                        w_ready[u] = 1
                i += 1
            pc[r] = i
        while heads:
            r = heads.pop()
            b = head[r]
            if b >= posted[r]:
                continue
            for key, r2, is_send in batch_keys[r][b]:
                if paired[key]:
                    continue
                b2 = recv_batch[key] if is_send else send_batch[key]
                if b2 != head[r2] or b2 >= posted[r2]:
                    continue
                paired[key] = 1
                pending[r][b] -= 1
                pending[r2][b2] -= 1
                if pending[r2][b2] == 0 and r2 != r:
                    head[r2] += 1
                    heads.append(r2)
                    ranks_to_run.append(r2)
            if pending[r][b] == 0 and head[r] == b:
                head[r] += 1
                heads.append(r)
                ranks_to_run.append(r)

    stuck = [r for r in range(P) if pc[r] < len(progs[r]) or head[r] < len(batch_keys[r])]
    if stuck:
        lines = []
        for r in stuck:
            if pc[r] < len(progs[r]):
                key, other = stuck_on[r]
                lines.append(f"rank {r} instruction {pc[r]} {progs[r][pc[r]]} waits for comm batch {recv_batch[key]} "
                             f"(the receive of {_data_name(key, S, M)} from rank {other}) to complete")
            else:
                lines.append(f"rank {r} comm batch {head[r]} never completes")
        raise ScheduleError("deadlock under rendezvous point-to-point semantics:\n  " + "\n  ".join(lines))
