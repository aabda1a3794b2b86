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
from .ir import FB, CommBatch, Program, Schedule
from .ops import (
    COMM_SHAPES,
    SENDS_TO,
    OpTable,
    Signal,
    signal_name,
)
from .simulate import run_schedule
from .structure import check_structure

__all__ = ["check_structure", "validate", "validate_program"]


@gc_paused
def validate(schedule: Schedule | Program) -> None:
    """Raise ScheduleError if ``schedule`` (or a program) cannot run; else return None."""
    if isinstance(schedule, Program):
        validate_program(schedule)
        return
    check_structure(schedule)
    run_schedule(schedule, record=False)  # raises on deadlock, naming the waiting ops


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
                shape = COMM_SHAPES.get(kind)
                if shape is None:
                    raise ScheduleError(f"rank {r} instruction {i} {cm}: unknown comm kind; "
                                        "allowed SEND_F, RECV_F, SEND_B, RECV_B")
                _, dps, dnx, bit, is_send = shape
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

    _check_both_ends(view, send_batch, recv_batch)
    for ch, (sends, recvs) in enumerate(channels):
        if sends != recvs:
            k = next((k for k, (a, b) in enumerate(zip(sends, recvs)) if a != b), min(len(sends), len(recvs)))
            if k == min(len(sends), len(recvs)):
                src, dst = divmod(ch, P)
                raise ScheduleError(f"channel rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")
            src, dst = divmod(ch, P)
            raise ScheduleError(
                f"channel rank {src} -> rank {dst}: send #{k} carries {signal_name(sends[k], S, M)} but receive "
                f"#{k} expects {signal_name(recvs[k], S, M)}; sends and receives must pair up in order")

    _rendezvous_run(program, view, batch_keys, send_batch, recv_batch, nkeys)


def _check_both_ends(view: Schedule, send_batch: list[int], recv_batch: list[int]) -> None:
    """Every signal that ``ops`` says travels to a stage on another rank has a send and a receive."""
    placement, M = view.placement, view.num_microbatches
    S = len(placement[0])
    for c, chain in enumerate(placement):
        mbs = view.microbatches_of(c)
        for sig, d in SENDS_TO.items():
            bit = int(sig is Signal.GRAD)
            for s in range(S):
                t = s + d
                if not 0 <= t < S or chain[s] == chain[t]:
                    continue
                for m in mbs:
                    key = 2 * ((c * S + s) * M + m) + bit
                    if send_batch[key] < 0:
                        raise ScheduleError(f"no send for {signal_name(key, S, M)} to rank {chain[t]}")
                    if recv_batch[key] < 0:
                        raise ScheduleError(f"no receive for {signal_name(key, S, M)} on rank {chain[t]}")


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
    nxt = cm.stage + COMM_SHAPES[cm.kind].peer_offset
    if not 0 <= nxt < S:
        return f"{loc}: there is no stage {nxt} to talk to"
    return f"{loc}: peer should be rank {chain[nxt]} (stage {nxt})"


def _rendezvous_run(program: Program, view: Schedule, batch_keys, send_batch, recv_batch, nkeys: int) -> None:
    """Execute the program under rendezvous semantics, checking data order on the way.

    Compute ops wait for the signals ``ops`` says they need: a local one must already be made, a
    remote one must have its receive posted earlier on this rank and its batch completed.
    """
    P = view.num_ranks
    progs = program.ranks
    run = _Rendezvous(program, view, batch_keys, send_batch, recv_batch, nkeys)
    run.run()

    stuck = [r for r in range(P) if run.pc[r] < len(progs[r]) or run.head[r] < len(batch_keys[r])]
    if stuck:
        raise ScheduleError("deadlock under rendezvous point-to-point semantics:\n  "
                            + "\n  ".join(run.stuck_line(r) for r in stuck))


class _Rendezvous:
    """State of the rendezvous execution: what is made, posted, paired; where each rank stands."""

    def __init__(self, program: Program, view: Schedule, batch_keys, send_batch, recv_batch, nkeys: int) -> None:
        P = view.num_ranks
        self.S, self.M = len(view.placement[0]), view.num_microbatches
        self.progs = program.ranks
        self.templates = OpTable(view.placement, self.M).templates()
        self.batch_keys, self.send_batch, self.recv_batch = batch_keys, send_batch, recv_batch
        self.done = bytearray(nkeys)  # signal made (F output / B input-grad), by its key
        self.paired = bytearray(nkeys)  # transfer completed
        self.posted_recv = bytearray(nkeys)
        self.pending = [[len(k) for k in kr] for kr in batch_keys]
        self.head = [0] * P
        self.posted = [0] * P
        self.pc = [0] * P
        self.stuck_on: dict[int, tuple[int, int]] = {}

    def fail(self, r: int, i: int, what: str) -> None:
        raise ScheduleError(f"rank {r} instruction {i} {self.progs[r][i]}: {what}")

    def advance(self, r: int, heads: list[int]) -> None:
        """Run rank ``r`` until it finishes or a compute op waits for an incomplete receive."""
        prog = self.progs[r]
        i, n = self.pc[r], len(prog)
        templates, S, done = self.templates, self.S, self.done
        posted_recv, recv_batch, head = self.posted_recv, self.recv_batch, self.head[r]
        while i < n:
            ins = prog[i]
            if type(ins) is CommBatch:  # post it: receives become visible, sends must have their data
                b = self.posted[r]
                for key, _, is_send in self.batch_keys[r][b]:
                    if not is_send:
                        posted_recv[key] = 1
                    elif not done[key]:
                        self.fail(r, i, f"sends {signal_name(key, S, self.M)} before it is computed")
                self.posted[r] = b + 1
                if b == head:
                    heads.append(r)
                i += 1
                continue
            for kind, c, s, m in (ins if type(ins) is FB else (ins,)):  # inputs, as ops defines them
                for key, owner, _ in templates[kind][c * S + s][0]:
                    key += m + m
                    if owner == r:
                        if not done[key]:
                            self.fail_missing(r, i, key, owner)
                    elif not posted_recv[key]:
                        self.fail_missing(r, i, key, owner)
                    elif recv_batch[key] >= head:
                        self.stuck_on[r] = (key, owner)  # formatted only if the run ends stuck
                        self.pc[r] = i
                        return
            for kind, c, s, m in (ins if type(ins) is FB else (ins,)):
                for key in templates[kind][c * S + s][1]:
                    done[key + m + m] = 1
            i += 1
        self.pc[r] = i

    def fail_missing(self, r: int, i: int, key: int, owner: int) -> None:
        """Raise for an input that is neither made locally nor received earlier on this rank."""
        name = signal_name(key, self.S, self.M)
        if owner == r:
            self.fail(r, i, f"waits for {name}, which rank {r} runs later or never")
        self.fail(r, i, f"needs {name} but its receive is not posted before it")

    def run(self) -> None:
        """Alternate: run ranks until they block, then complete head batches whose both ends are posted.

        Completing a batch pairs each transfer whose other end sits in its rank's head batch; a
        rank whose head batch completes moves on (its next batch becomes the head) and runs again.
        """
        head, pending, posted, paired = self.head, self.pending, self.posted, self.paired
        batch_keys, send_batch, recv_batch = self.batch_keys, self.send_batch, self.recv_batch
        ranks_to_run = list(range(len(head)))
        heads: list[int] = []
        while ranks_to_run or heads:
            while ranks_to_run:
                self.advance(ranks_to_run.pop(), heads)
            while heads:
                r = heads.pop()
                b = head[r]
                if b >= posted[r]:
                    continue
                for key, r2, is_send in batch_keys[r][b]:
                    b2 = recv_batch[key] if is_send else send_batch[key]
                    if paired[key] or b2 != head[r2] or b2 >= posted[r2]:
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

    def stuck_line(self, r: int) -> str:
        if self.pc[r] < len(self.progs[r]):
            key, other = self.stuck_on[r]
            return (f"rank {r} instruction {self.pc[r]} {self.progs[r][self.pc[r]]} waits for comm batch "
                    f"{self.recv_batch[key]} (the receive of {signal_name(key, self.S, self.M)} from rank {other}) "
                    "to complete")
        return f"rank {r} comm batch {self.head[r]} never completes"
