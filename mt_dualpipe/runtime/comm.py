"""Batched point-to-point communication with learned shapes and timed waits.

One ``CommBatch`` of the program becomes one ``batch_isend_irecv`` call. A message is what one
SEND carries: the tensors a stage's F outputs, or the input gradients its B produced (``None``
where an input has no gradient). Messages are keyed ``(signal, chain, sending stage, mb)``, the
signal ("F": an activation, "B": an input gradient) and the sending stage as ``schedules.ops``
defines them (``message_key``).

The step-start agreement (below) also carries a row of integers from every rank (``begin_step``'s
``checks``), so a mistake made on one rank only fails on every rank at once (``step_checks``).

Shapes are never configured. The first time a message key is used, both sides exchange a small
metadata tensor (tag ``META_TAG``, on a gloo side group when the data backend is not gloo) that
lists each tensor's dtype and shape, then cache it; later steps post the data directly. A sender
whose tensors differ from what the key's cache says within a step raises ``PipelineError``
instead of sending.

When the caches are dropped. Every rank must drop them in the same step, or a receiver posts a
buffer of the old size while its sender sends metadata. Each rank compares a fingerprint of its
step (its inputs' shapes and dtypes, the number of micro-batches) with its last step's, and a
rank whose last step failed (``forget``) must relearn too; one agreement, a sum of every rank's flag
and checks, tells every rank. It is posted when the step begins and waited for only right before the
first use of the cache (the rank's first ``post``), so a rank that starts with compute (the first stage
runs F on its inputs first) overlaps it. An agreement is a star over the link (``agree.py``: every
rank's row to pipeline rank 0, the total back), about a quarter of the CPU of gloo's all-reduce. Other
designs were ruled out: only the input-holding ranks can see an input change, but any rank's failure
must reach every rank too; a lazy scheme where receivers post cached sizes and notice a change from
the message size cannot work on gloo, which fails a receive of the wrong size. A pipeline of one rank
has nobody to agree with: its own row is the agreement, and neither agreement (this one, nor the
end-of-step one below) is posted.

Every wait has a timeout; a wait that expires raises ``PipelineTimeoutError`` naming the rank, the
instruction, the peer and the message.

When a rank fails. The gloo traffic (the messages of a gloo pipeline, the metadata and both
agreements on any backend) runs on the pipeline's own link (``link.py``). A rank whose step raises
writes why on the link's board and closes the link (``fail``); a wait that breaks, or expires,
closes this rank's link too, so the failure reaches every rank blocked on another within
milliseconds, and each raises ``PipelinePeerError`` naming the rank that failed, its op and the
cause. A rank can finish all its instructions before a peer fails (the peer's last W), so the step
ends with a second agreement on the link (posted in ``finish`` before the last sends are waited
for): a rank returns only once every rank has finished, and raises if one failed instead.
Every rank closed its link in a failed step, so every rank opens a fresh one in the next.
"""

from __future__ import annotations

import datetime
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..schedules.ops import RULES, SEND_RECV, SIGNAL_OF_COMM
from .agree import END_TAG, START_TAG, StarSum
from .errors import PipelineCommError, PipelineError, PipelinePeerError, PipelineTimeoutError
from .link import Link
from .streams import StreamSync

META_TAG = 1
DATA_TAG = 0
META_LEN = 256
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))
_CODE = {d: i for i, d in enumerate(DTYPES)}
BOARD_GRACE = 2.0
"""Seconds a rank whose wait broke polls the board for the failing rank's line before raising its own error: a
wait can break on a peer's failure before that peer's line is readable (a rank closes its link as soon as its
own wait breaks, which can be before the rank that failed first has written), and without the line every rank
but the failing one would raise a bare communication error."""

Meta = tuple  # per tensor: (dtype, shape) or None


def describe(meta: Meta) -> str:
    return "[" + ", ".join("None" if m is None else f"{tuple(m[1])} {str(m[0]).replace('torch.', '')}"
                           for m in meta) + "]"


def meta_of(tensors: Sequence[torch.Tensor | None]) -> Meta:
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


def encode(meta: Meta) -> torch.Tensor:
    flat = [len(meta)]
    for m in meta:
        if m is None:
            flat += [-1, 0]
        else:
            if m[0] not in _CODE:
                raise PipelineError(f"cannot send dtype {m[0]}; supported: {', '.join(str(d) for d in DTYPES)}")
            flat += [_CODE[m[0]], len(m[1]), *m[1]]
    if len(flat) > META_LEN:
        raise PipelineError(f"message metadata needs {len(flat)} integers, more than {META_LEN}: too many tensors "
                            "or dimensions in one stage output")
    buf = torch.zeros(META_LEN, dtype=torch.int64)
    buf[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
    return buf


def decode(buf: torch.Tensor) -> Meta:
    vals = buf.tolist()
    n, i, out = vals[0], 1, []
    for _ in range(n):
        code, ndim = vals[i], vals[i + 1]
        i += 2
        if code < 0:
            out.append(None)
        else:
            out.append((DTYPES[code], tuple(vals[i: i + ndim])))
            i += ndim
    return tuple(out)


_SENT_FROM = {sig: ds for r in RULES.values() for sig, ds in r.needs if ds}
"""Per signal, the stage offset its consumer receives it from (ACT from the stage before, GRAD after)."""


def message_key(kind: str, chain: int, stage: int, mb: int) -> tuple:
    """The key of the message a comm op moves: (signal, chain, sending stage, mb).

    ``stage`` is the comm op's local stage: the sender's for a send, the consumer's for a receive,
    whose sending stage follows from the rule in ``schedules.ops``.
    """
    sig = SIGNAL_OF_COMM[kind]
    if kind == SEND_RECV[sig][0]:
        return (sig.value, chain, stage, mb)
    return (sig.value, chain, stage + _SENT_FROM[sig], mb)


class _Recv:
    """A posted receive: data buffers (None while only the metadata receive ``meta`` is posted)."""

    __slots__ = ("bufs", "works", "where", "comm", "event", "meta")

    def __init__(self, bufs, works, where, comm, event, meta=None):
        self.bufs, self.works, self.where, self.comm, self.event, self.meta = bufs, works, where, comm, event, meta


class P2P:
    """Point-to-point messaging of one rank of a pipeline (see the module docstring)."""

    def __init__(self, rank: int, peers_global: Sequence[int], group: Any, device: torch.device,
                 timeout: float):
        self.rank = rank
        self.rank_name = f"rank {rank}"
        self.peers_global = list(peers_global)  # pipeline rank -> global rank
        self.group = group
        self.device = torch.device(device)
        self.timeout = float(timeout)
        backend = dist.get_backend(group)
        self.link = Link(group, rank, len(self.peers_global))  # opened by the first step (link.py)
        self.pg: Any = None  # the link of the current step; pipeline ranks are its ranks
        # the timeline's gather (a registered gloo group); the messages themselves use the link
        self.meta_group = group if backend == "gloo" else dist.new_group(self.peers_global, backend="gloo")
        # gloo: the messages on the link, each op posted straight (gloo has no coalescing)
        self.direct = backend == "gloo"
        self.sync = StreamSync(self.device)
        self.cache: dict[tuple, Meta] = {}
        self.fingerprint: int | None = None
        self.agreement: tuple | None = None  # (agreement, flag, row width) of the step start until settled
        self.on_agreement: Callable[[list[list[int]]], None] | None = None  # checks every rank's row
        self._td: datetime.timedelta | None = None  # the timeout as a timedelta, rebuilt when it changes
        self.recvs: dict[tuple, _Recv] = {}
        self.sends: deque[tuple] = deque()  # (works, tensors to free, where, comm), oldest first
        self.tag_chains, self.tag_stages = 1, 1
        self.steps = 0  # steps begun: the same count on every rank, the board's key (link.py)
        self.refused = False  # on_agreement refused this step (on every rank alike)
        self.ended = False  # this step's end-of-step agreement completed: every rank finished it
        self._done = torch.zeros(1, dtype=torch.int64)  # what the end-of-step agreement carries (a sum of zeros)

    # ----- per step ---------------------------------------------------------------------------
    def begin_step(self, signature: object, checks: Sequence[int] = (), failure: str | None = None) -> None:
        """Post this step's agreement on whether shapes must be learned again (see the module docstring).

        ``checks``: integers every rank contributes (the same number on every rank); after the
        agreement every rank holds every rank's row, and ``on_agreement(rows)`` (if set) can refuse
        the step on all ranks at once, naming the rank that differs. Non-blocking: the agreement's
        messages go out in the background, and it is settled at the first ``post`` (or at ``finish``),
        before any learned shape is used. ``failure``: why this rank cannot run the step, written on the board
        before the agreement is posted, so every peer can name it once the agreement is done. Opens
        the link first (a fresh one after a failed step: a rendezvous of every rank).
        """
        self.steps += 1
        self.refused = self.ended = False
        if failure is not None:
            self.link.report(self.steps, failure)
        pg = self.pg = self.link.open(self.timeout)
        fp = zlib.crc32(repr(signature).encode())
        width = 1 + len(checks)
        vals = [0] * (width * len(self.peers_global))
        vals[self.rank * width] = int(fp != self.fingerprint)
        vals[self.rank * width + 1: (self.rank + 1) * width] = checks
        flag = torch.tensor(vals, dtype=torch.int64)
        size = len(self.peers_global)
        work = StarSum(pg, self.rank, size, START_TAG, flag) if size > 1 else None  # a sum; one rank: its own row
        self.fingerprint = fp
        self.agreement = (work, flag, width)

    def settle(self) -> bool:
        """Wait for the step's agreement; drop every learned shape if any rank asked. True if dropped.

        Raises what ``on_agreement`` raises when the ranks' checks disagree.
        """
        work, flag, width = self.agreement
        self.agreement = None
        if work is not None:
            self._wait([work], (0, "step start"), "every rank to start the step (step-start agreement)", -1)
        vals = flag.tolist()
        rows = [vals[i: i + width] for i in range(0, len(vals), width)]
        if self.on_agreement is not None:
            try:
                self.on_agreement([r[1:] for r in rows])
            except PipelineError:
                self.refused = True  # every rank refuses alike: nothing to tell (fail)
                raise
        if any(r[0] for r in rows):
            self.cache.clear()
            return True
        return False

    def start_step(self, signature: object) -> bool:
        """``begin_step`` and ``settle`` at once; returns True if the shapes must be learned again."""
        self.begin_step(signature)
        return self.settle()

    def forget(self) -> None:
        """Drop every learned shape and pending message (after a failed step): every rank relearns next step."""
        self.cache.clear()
        self.fingerprint = None
        self.agreement = None  # an agreement still in flight dies with the closed link
        self.recvs.clear()
        self.sends.clear()

    def fail(self, exc: BaseException) -> BaseException:
        """What this rank raises for a step that ``exc`` stopped (see "When a rank fails" above).

        ``exc`` from a wait that broke (the link is closed: a peer closed it): the ``PipelinePeerError``
        naming the rank that failed, as its board says, or ``exc`` itself when no rank wrote there (a
        peer that died or hangs). A refused step: ``exc``, or the failure a rank wrote when it could not
        prepare the step. After the end-of-step agreement: ``exc`` (every peer finished the step).
        Otherwise this rank failed: it writes ``exc`` on the board, closes the link, and gets
        ``exc`` back, as a ``PipelineError`` if it is another ``Exception`` (a ``KeyboardInterrupt``
        stays what it is).
        """
        if self.ended:
            return exc
        if isinstance(exc, Exception) and (self.refused or not self.link.is_open):
            reports = self.link.reports(self.steps)
            deadline = time.monotonic() + BOARD_GRACE
            while not reports and not self.refused and time.monotonic() < deadline:
                time.sleep(0.01)
                reports = self.link.reports(self.steps)
            if not reports:
                return exc
            rank = min(reports)
            return PipelinePeerError(f"{self.rank_name}: rank {rank} failed, so every rank of the pipeline stopped "
                                     f"this step: {reports[rank]}", rank, reports[rank])
        if not self.link.is_open:  # interrupted after a peer's failure: nothing left to tell
            return exc
        text = describe_failure(exc, self.rank_name)
        self.link.report(self.steps, text)
        self.link.close()
        if isinstance(exc, PipelineError) or not isinstance(exc, Exception):
            return exc
        return PipelineError(text)

    def _timeout_error(self, where: tuple, what: str | Callable[[], str], peer: int, exc: BaseException | None,
                       how: str = "failed waiting") -> PipelineCommError:
        idx, op = where
        if callable(what):
            what = what()
        text = str(exc).splitlines()[0][:200] if exc is not None else ""
        timed_out = exc is None or "imed out" in text
        if timed_out:
            how = f"waited more than {self.timeout:g}s"
        cause = f" ({text})" if text else ""
        return (PipelineTimeoutError if timed_out else PipelineCommError)(
            f"rank {self.rank}: instruction {idx} {op} {how} for {what} with "
            f"{'peer rank ' + str(peer) if peer >= 0 else 'the other ranks'}; "
            f"the peer is hung, failed or runs a different program{cause}")

    def _wait(self, works: Sequence[Any], where: tuple, what: str | Callable[[], str], peer: int) -> None:
        """Wait for ``works``; ``what`` (text, or a function making it: formatted only on failure) names them."""
        td = self._td
        if td is None or td.total_seconds() != self.timeout:
            td = self._td = datetime.timedelta(seconds=self.timeout)
        for w in works:
            try:
                ok = w.wait(td)
            except RuntimeError as exc:
                self.link.close()  # so the ranks blocked on this one wake too
                raise self._timeout_error(where, what, peer, exc) from None
            if ok is False:
                self.link.close()
                raise self._timeout_error(where, what, peer, None)

    # ----- posting ----------------------------------------------------------------------------
    def tag(self, key: tuple) -> int:
        """A tag unique to the message within a step, so gloo matches messages by key, not by order."""
        d, c, s, m = key
        return DATA_TAG + 2 + 2 * ((m * self.tag_stages + s) * self.tag_chains + c) + (d == "B")

    def set_shape(self, num_chains: int, num_stages: int) -> None:
        self.tag_chains, self.tag_stages = num_chains, num_stages

    def post(self, where: tuple, sends: Sequence[tuple], recvs: Sequence[tuple]) -> None:
        if self.agreement is not None:
            self.settle()
        try:
            self._post(where, sends, recvs)
        except RuntimeError as exc:
            if isinstance(exc, PipelineError):
                raise
            self.link.close()
            peers = sorted({c.peer for c, *_ in list(sends) + list(recvs)})
            raise self._timeout_error(where, "posting its messages", peers[0] if len(peers) == 1 else -1, exc,
                                      "failed") from None

    def _post(self, where: tuple, sends: Sequence[tuple], recvs: Sequence[tuple]) -> None:
        """Post one batch. ``sends``: (comm, key, tensors, free); ``recvs``: (comm, key).

        ``where`` is (instruction index, instruction) for error messages. Received tensors are
        taken later with ``take``; sent tensors listed in ``free`` lose their storage once sent.
        A message whose shapes are not known yet sends its metadata first; its receive is posted
        when the metadata is there, at ``take`` (so posting never blocks).
        """
        self._reap()
        for comm, key, tensors, _ in sends:
            self._check_or_announce(where, comm, key, tensors)
        if self.direct:
            self._post_direct(where, sends, recvs)
            return
        ops: list = []
        owner: list[int] = []  # per op: index in sends (>= 0) or -1 - index in recvs
        for i, (comm, key, tensors, _) in enumerate(sends):
            dst, tag = comm.peer, self.tag(key)
            for t in tensors:
                if t is not None:
                    ops.append((True, _sendable(t), dst, tag))
                    owner.append(i)
        late = []
        for i, (comm, key) in enumerate(recvs):
            meta = self.cache.get(key)
            if meta is None:  # learn the shapes first; the data receive is posted at take()
                buf = torch.empty(META_LEN, dtype=torch.int64)
                work = self.pg.recv([buf], comm.peer, META_TAG)
                late.append((comm, key, work, buf))
                continue
            bufs = self._recv_ops(comm, key, meta, ops, owner, -1 - i)
            self.recvs[key] = _Recv(bufs, [], where, comm, None)
        works = self._launch(ops)
        event = self.sync.record()
        per_op = len(works) == len(ops)
        for i, (comm, _, _, free) in enumerate(sends):
            mine = [w for w, j in zip(works, owner) if j == i] if per_op else works
            self.sends.append((mine, _weak(free), where, comm))
        for i, (_, key) in enumerate(recvs):
            r = self.recvs.get(key)
            if r is not None and r.where is where:
                r.works = [w for w, j in zip(works, owner) if j == -1 - i] if per_op else works
                r.event = event
        for comm, key, work, buf in late:
            self.recvs[key] = _Recv(None, [work], where, comm, None, buf)

    def _check_or_announce(self, where: tuple, comm: Any, key: tuple, tensors: Sequence[Any]) -> None:
        """Send a new key's metadata first; refuse tensors that differ from the key's learned shapes."""
        meta = meta_of(tensors)
        known = self.cache.get(key)
        if known is None:
            self.cache[key] = meta
            work = self.pg.send([encode(meta)], comm.peer, META_TAG)
            self.sends.append(([work], [], where, comm))
        elif meta != known:
            raise PipelineError(
                f"rank {self.rank}: instruction {where[0]} {comm}: the stage produced tensors "
                f"{describe(meta)} but peer rank {comm.peer} expects {describe(known)} in this step; "
                "shapes and dtypes may change between steps (when the inputs change), not within one")

    def _post_direct(self, where: tuple, sends: Sequence[tuple], recvs: Sequence[tuple]) -> None:
        """gloo: each tensor straight on the link (what isend/irecv end in), one work each."""
        g, tag_of, dev = self.pg, self.tag, self.device
        for comm, key, tensors, free in sends:
            dst, tag = comm.peer, tag_of(key)
            works = [g.send([_sendable(t)], dst, tag) for t in tensors if t is not None]
            self.sends.append((works, _weak(free), where, comm))
        for comm, key in recvs:
            meta = self.cache.get(key)
            if meta is None:  # learn the shapes first; the data receive is posted at take()
                buf = torch.empty(META_LEN, dtype=torch.int64)
                self.recvs[key] = _Recv(None, [g.recv([buf], comm.peer, META_TAG)], where, comm, None, buf)
                continue
            src, tag = comm.peer, tag_of(key)
            bufs = [None if m is None else torch.empty(m[1], dtype=m[0], device=dev) for m in meta]
            self.recvs[key] = _Recv(bufs, [g.recv([b], src, tag) for b in bufs if b is not None], where, comm, None)

    def _recv_ops(self, comm, key, meta: Meta, ops: list, owner: list, slot: int) -> list:
        src, tag = comm.peer, self.tag(key)
        bufs = []
        for m in meta:
            if m is None:
                bufs.append(None)
                continue
            b = torch.empty(m[1], dtype=m[0], device=self.device)
            ops.append((False, b, src, tag))
            owner.append(slot)
            bufs.append(b)
        return bufs

    def _launch(self, ops: list) -> list:
        """Post ``ops`` = [(is_send, tensor, pipeline peer, tag)] as one batch; one work per op (or per batch)."""
        if not ops:
            return []
        if self.direct:
            g = self.pg
            return [g.send([t], peer, tag) if is_send else g.recv([t], peer, tag) for is_send, t, peer, tag in ops]
        glob = self.peers_global
        with self.sync.comm():
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if is_send else dist.irecv, t, glob[peer], self.group,
                                                      tag) for is_send, t, peer, tag in ops])

    # ----- completion ---------------------------------------------------------------------------
    def take(self, key: tuple, consumer: tuple, requires_grad: bool) -> list[torch.Tensor | None]:
        """Wait for the message ``key`` (right before ``consumer`` = (index, op) uses it) and return it."""
        r = self.recvs.pop(key, None)
        if r is None:
            raise PipelineError(f"rank {self.rank}: instruction {consumer[0]} {consumer[1]} needs message {key} "
                                "but no instruction before it received it; the program is not a valid lowering")
        if r.bufs is None:  # shapes first (learning step), then the data
            self._wait(r.works, consumer, f"the shapes of {r.comm} (posted by instruction {r.where[0]})",
                       r.comm.peer)
            meta = self.cache[key] = decode(r.meta)
            ops, owner = [], []
            r.bufs = self._recv_ops(r.comm, key, meta, ops, owner, 0)
            r.works = self._launch(ops)
            r.event = self.sync.record()
        self._wait(r.works, consumer, lambda: f"{r.comm} (posted by instruction {r.where[0]})", r.comm.peer)
        if r.event is not None:
            self.sync.consume(r.event, [b for b in r.bufs if b is not None])
        if requires_grad:
            for b in r.bufs:
                if b is not None and (b.is_floating_point() or b.is_complex()):
                    b.requires_grad_()
        return r.bufs

    def _reap(self) -> None:
        """Release the storage of sends that have completed (never blocks)."""
        sends = self.sends
        while sends and all(w.is_completed() for w in sends[0][0]):  # oldest first; stop at one in flight
            _release(sends.popleft()[1])

    def finish(self, where: tuple) -> None:
        """Wait for every outstanding send and for every rank to finish the step; called at the end of a step.

        The end-of-step agreement is posted first, so it overlaps the waits for the last sends.
        """
        if self.agreement is not None:
            self.settle()
        size = len(self.peers_global)
        done = StarSum(self.pg, self.rank, size, END_TAG, self._done) if size > 1 else None  # one rank: it has
        for works, free, _, comm in self.sends:
            self._wait(works, where, lambda c=comm: f"{c} to complete", comm.peer)
            _release(free)
        self.sends.clear()
        if done is not None:
            self._wait([done], where, "every rank to finish the step (end-of-step agreement)", -1)
        self.ended = True
        if self.recvs:
            keys = ", ".join(str(k) for k in self.recvs)
            self.recvs.clear()
            raise PipelineError(f"rank {self.rank}: the step ended with received messages nobody used: {keys}")


def describe_failure(exc: BaseException, rank_name: str) -> str:
    """The line a failing rank writes on the board: its rank, the op and the cause.

    A ``PipelineError`` names them already (a stage's error says ``rank r F(chain c, stage s, mb m)
    in Module: ValueError: ...``); anything else gets the rank and its type prepended.
    """
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    if isinstance(exc, PipelineError) and first.startswith(rank_name):
        return first
    return f"{rank_name}: {type(exc).__name__}: {first}" if first else f"{rank_name}: {type(exc).__name__}"


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """What a send holds until it completes: the data, never the autograd graph.

    A pending send keeps its tensor alive; the output itself would keep the stage's whole graph (and
    under the split, B's retained saved tensors) alive until the send is reaped — on gloo, whose
    sends report completion only once waited on, until the step's end."""
    return t.detach() if t.is_contiguous() else t.detach().contiguous()


def _weak(tensors: Sequence[torch.Tensor]) -> list[weakref.ref]:
    """The outputs whose storage a completed send releases, held weakly: once W dropped one, it is gone."""
    return [weakref.ref(t) for t in tensors]


def _release(refs: Sequence[weakref.ref]) -> None:
    """Drop a sent output's storage (if the stage still holds it); its autograd graph stays for the backward."""
    for ref in refs:
        t = ref()
        if t is not None:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
