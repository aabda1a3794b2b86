"""The executor: one loop over one rank's ``Program``, dispatching on the op kind.

There is no schedule-specific code here. What an op waits for and what it makes comes from
``mt_dualpipe.schedules.ops`` (``producers``, ``SIGNAL_OF_COMM``, ``SEND_RECV``); the executor
only maps each need to where this rank finds it: the step's micro-batch (a chain's first stage),
a stage of the same rank (the turn of a V: handed over locally) or a posted receive, waited for
right before the op. A ``CommBatch`` is posted at once and never waited for; sends complete in
the background and their outputs' storage is released once they have. Peak live activations
follow the simulator's rule (+1 at F, -1 at W or BW), so the recorded peak can be compared with
``simulate()``; with ``record_bytes`` a step also records the peak of saved-activation *bytes* this
rank's stages held (``activation_bytes.py``), which the planner's memory estimate is checked against.

Per step the loop only dispatches: everything an instruction needs (its stage, a bound method
that fetches its inputs or output gradients, each comm op's message key) is resolved once per
program into a plan of typed entries (``Executor.plan``). An ``FB`` unit is planned as its two
halves, each resolved like a plain op, so there is one way to find an op's inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ..parallel.stage_sync import StageGradSync
from ..schedules.ir import FB, CommBatch, Op, Program
from ..schedules.ops import COMM_KINDS, SEND_RECV, SIGNAL_OF_COMM, OpKind, Signal, producers
from ..schedules.timeline import TimelineEvent
from .activation_bytes import ActivationBytes
from .comm import P2P, message_key
from .errors import PipelineError
from .overlap import overlap_enabled, overlap_wanted, run_overlapped
from .stage import Stage
from .weight_grad import WeightGradStore

F, B, W, BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
FB_KIND, COMM, REDUCE = OpKind.FB, OpKind.COMM, OpKind.REDUCE_GRAD
ACT = Signal.ACT
SENDS = {SEND_RECV[sig][0]: sig for sig in SEND_RECV}  # send kind -> the signal it carries


def _releasable(t: torch.Tensor, inputs: Sequence[Any], training: bool) -> bool:
    """Whether a sent output's storage may be dropped: not a view, not an input, not saved by its own node."""
    if t._base is not None or any(t is x for x in inputs):
        return False
    if training:
        return t.grad_fn is not None and not hasattr(t.grad_fn, "_saved_result")
    return True


def _no_grads() -> None:
    """The output gradients of a chain's last stage: none, its B starts from the loss."""
    return None


# ----- plan entries ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlannedComm:
    """One comm op of a batch: its stage, its message key and, for a send, the signal it carries."""

    op: Any
    stage: Stage
    key: tuple
    sends: Signal | None  # None: a receive


@dataclass(frozen=True, slots=True)
class PlannedPost:
    """A ``CommBatch``: posted at once."""

    index: int
    batch: CommBatch
    comms: tuple[PlannedComm, ...]
    kind: OpKind = COMM


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """F, B, BW or W of one stage. ``fetch()`` returns its inputs (F) or output gradients (B, BW)."""

    kind: OpKind
    index: int
    op: Op
    stage: Stage
    fetch: Callable[[], Any] | None


@dataclass(frozen=True, slots=True)
class PlannedFB:
    """An F&B unit: its two halves, each planned like a plain op."""

    index: int
    item: FB
    f: PlannedOp
    b: PlannedOp
    overlapped: Any  # the stage class's ``overlapped_forward_backward``, or None: run F then B
    kind: OpKind = FB_KIND


@dataclass(frozen=True, slots=True)
class PlannedReduce:
    """REDUCE_GRAD of one stage: post its data-parallel gradient reduction (``sync.start()``), don't wait."""

    index: int
    op: Op
    sync: StageGradSync  # begin_step(), start(), wait() (parallel/stage_sync.py)
    kind: OpKind = REDUCE


Planned = PlannedPost | PlannedOp | PlannedFB | PlannedReduce


class RunResult:
    """What one ``Executor.run`` returns: losses and outputs per micro-batch, the peak in micro-batches,
    the events, and ``peak_activation_bytes``: the peak of saved-activation bytes this rank's stages
    held (``activation_bytes.py``; None unless the step recorded it)."""

    __slots__ = ("losses", "outputs", "peak_activations", "events", "peak_activation_bytes")

    def __init__(self, losses, outputs, peak, events, peak_bytes=None):
        self.losses, self.outputs, self.peak_activations, self.events = losses, outputs, peak, events
        self.peak_activation_bytes = peak_bytes


class Executor:
    """Runs the program of ``rank`` with this rank's stage modules (in ``local_stages`` order)."""

    def __init__(self, program: Program, rank: int, modules: Sequence[nn.Module], p2p: P2P,
                 store: WeightGradStore, syncs: dict[tuple[int, int], StageGradSync] | None = None,
                 rank_name: str | None = None):
        sched = program.schedule
        self.program, self.rank, self.p2p, self.store = program, rank, p2p, store
        self.syncs = dict(syncs or {})
        self.rank_name = rank_name or f"rank {rank}"
        self.placement = sched.placement
        local = sched.local_stages(rank)
        if len(local) != len(modules):
            raise PipelineError(
                f"rank {rank} runs {len(local)} stage(s) {local} of schedule {sched.name!r} but was given "
                f"{len(modules)} module(s); pass one module per stage, in (chain, stage) order")
        split = {(ins.chain, ins.stage) for ins in program.ranks[rank] if isinstance(ins, Op) and ins.kind == W}
        self.stages = {(c, s): Stage(m, c, s, s == 0, s == len(self.placement[c]) - 1, store, rank=rank,
                                     rank_name=self.rank_name, splits=(c, s) in split)
                       for (c, s), m in zip(local, modules)}
        fused: dict[tuple[int, int], set[int]] = {}  # per stage, the micro-batches whose backward is a BW
        for ins in program.ranks[rank]:
            op = ins.b if type(ins) is FB else ins
            if type(op) is Op and op.kind == BW:
                fused.setdefault((op.chain, op.stage), set()).add(op.mb)
        for key, mbs in fused.items():
            if key in self.stages:
                self.stages[key].fused = frozenset(mbs)
        self._programs: dict[bool, list[tuple[int, Any]]] = {}
        self._plans: dict[bool, list[Planned]] = {}
        self._tag_shape = (len(self.placement), max(len(c) for c in self.placement))
        self.inputs: dict[int, tuple] | None = None
        self.labels: dict[int, tuple] | None = None
        self.recorder: ActivationBytes | None = None  # set while a step records activation bytes

    def instructions(self, forward_only: bool) -> list[tuple[int, Any]]:
        """(index in the program, instruction); forward-only drops backward ops and their messages."""
        if forward_only not in self._programs:
            out = []
            for i, ins in enumerate(self.program.ranks[self.rank]):
                if not forward_only:
                    out.append((i, ins))
                elif type(ins) is CommBatch:
                    ops = tuple(c for c in ins.ops if SIGNAL_OF_COMM[c.kind] is ACT)
                    if ops:
                        out.append((i, CommBatch(ops)))
                elif type(ins) is FB:
                    out.append((i, ins.f))
                elif ins.kind == F:
                    out.append((i, ins))
            self._programs[forward_only] = out
        return self._programs[forward_only]

    def plan(self, forward_only: bool) -> list[Planned]:
        """The instructions with everything a step would look up per op resolved once per program.

        Built on first use, so an invalid program fails in the step that first runs it, with the
        same errors as before.
        """
        if forward_only not in self._plans:
            training = not forward_only
            self._plans[forward_only] = [self._plan_one(i, ins, training)
                                         for i, ins in self.instructions(forward_only)]
        return self._plans[forward_only]

    # ----- planning ---------------------------------------------------------------------------------
    def _stage(self, idx: int, op: Any) -> Stage:
        st = self.stages.get((op.chain, op.stage))
        if st is None:
            raise PipelineError(f"{self.rank_name}: instruction {idx} {op} names a stage this rank does not run")
        return st

    def _plan_one(self, idx: int, ins: Any, training: bool) -> Planned:
        if type(ins) is CommBatch:
            comms = []
            for c in ins.ops:
                kind = OpKind(c.kind)
                if kind not in COMM_KINDS:
                    raise PipelineError(f"{self.rank_name}: instruction {idx} {c} has unknown kind {c.kind!r}")
                comms.append(PlannedComm(c, self._stage(idx, c), message_key(c.kind, c.chain, c.stage, c.mb),
                                         SENDS.get(kind)))
            return PlannedPost(idx, ins, tuple(comms))
        if type(ins) is FB:
            f, b = self._plan_op(idx, ins.f, training), self._plan_op(idx, ins.b, training)
            cls = type(f.stage.module)
            overlapped = getattr(cls, "overlapped_forward_backward", None) if cls is type(b.stage.module) else None
            return PlannedFB(idx, ins, f, b, overlapped)
        if ins.kind == REDUCE:
            return self._plan_reduce(idx, ins)
        return self._plan_op(idx, ins, training)

    def _plan_reduce(self, idx: int, op: Op) -> PlannedReduce:
        self._stage(idx, op)
        sync = self.syncs.get((op.chain, op.stage))
        if sync is None:
            raise PipelineError(f"{self.rank_name}: instruction {idx} {op} reduces stage (chain {op.chain}, stage "
                                f"{op.stage}) but the pipeline has no data-parallel group for it; build the Pipeline "
                                "with mesh=init_parallel(pp=..., dp=...) or pass a schedule without REDUCE_GRAD")
        return PlannedReduce(idx, op, sync)

    def _plan_op(self, idx: int, op: Op, training: bool) -> PlannedOp:
        kind = OpKind(op.kind)
        st = self._stage(idx, op)
        if kind is W:
            return PlannedOp(kind, idx, op, st, None)
        return PlannedOp(kind, idx, op, st, self._fetcher(idx, op, kind, training))

    def _fetcher(self, idx: int, op: Op, kind: OpKind, training: bool) -> Callable[[], Any]:
        """Where this rank finds what ``op`` waits for from another stage (ops.producers says what)."""
        s, m = op.stage, op.mb
        other = [n for n in producers(op, self.placement) if n.stage != s]
        if not other:  # nothing from another stage: the chain's input (F) or the local loss (B, BW)
            return partial(self._step_inputs, op) if kind is F else _no_grads
        need, = other
        if need.rank == self.rank:  # the turn of a V: handed over locally
            src = self.stages[need.chain, need.stage]
            return partial(self._handed_over, src, m) if kind is F else partial(src.take_input_grads, m)
        key = (need.signal.value, need.chain, need.stage, need.mb)
        return partial(self.p2p.take, key, (idx, op), training and kind is F)

    # ----- one step -----------------------------------------------------------------------------
    def run(self, inputs: dict[int, tuple], labels: dict[int, tuple], criterion: Callable | None,
            forward_only: bool, keep_outputs: bool, record: bool, checks: Sequence[int] = (),
            record_bytes: bool = False) -> RunResult:
        """One step. ``checks``: this rank's part of the step-start agreement (see ``P2P.begin_step``);
        ``record_bytes``: record the peak of saved-activation bytes (``RunResult.peak_activation_bytes``)."""
        if not record_bytes or forward_only:
            return self._run(inputs, labels, criterion, forward_only, keep_outputs, record, checks)
        self.recorder = ActivationBytes(p for st in self.stages.values() for p in st.module.parameters())
        try:
            with self.recorder.recording():
                res = self._run(inputs, labels, criterion, forward_only, keep_outputs, record, checks)
        finally:
            recorder, self.recorder = self.recorder, None
        res.peak_activation_bytes = recorder.peak
        return res

    def _run(self, inputs: dict[int, tuple], labels: dict[int, tuple], criterion: Callable | None,
             forward_only: bool, keep_outputs: bool, record: bool, checks: Sequence[int]) -> RunResult:
        self._begin(inputs, labels, criterion, forward_only, keep_outputs, checks)
        events: list[TimelineEvent] | None = [] if record else None
        p2p = self.p2p
        clock = time.time
        rank = self.rank
        for e in self.plan(forward_only):
            kind = e.kind
            if kind is COMM:
                self._post(e)
                continue
            if kind is REDUCE:
                self._reduce(e, events)
                continue
            if kind is F:
                got = e.fetch()
                start = clock()
                self._forward(e.stage, e.op.mb, got)
            elif kind is W:
                start = clock()
                e.stage.weight(e.op.mb)
                self.live -= 1
            elif kind is FB_KIND:
                start = self._fb(e)
            elif kind is B:
                start = self._split_b(e)
            else:
                grads = e.fetch()
                start = clock()
                e.stage.backward(e.op.mb, grads, False)
                self.live -= 1
            if record:
                end = clock()
                if kind is FB_KIND:
                    f, bk = e.item.f, e.item.b
                    events.append(TimelineEvent(rank, "FB", f.chain, f.stage, f.mb, start, end,
                                                (bk.kind, bk.chain, bk.stage, bk.mb)))
                else:
                    op = e.op
                    events.append(TimelineEvent(rank, op.kind, op.chain, op.stage, op.mb, start, end))
        p2p.finish((len(self.program.ranks[self.rank]), "end of step"))
        if self.training:
            self._wait_syncs(events)
        if len(self.store):
            raise PipelineError(f"{self.rank_name}: the step ended with {len(self.store)} deferred weight-gradient "
                                "group(s) that no W ran")
        losses, outputs = {}, {}
        for st in self.stages.values():
            if st.is_last:
                losses.update(st.losses)
                if keep_outputs:
                    outputs.update(st.outputs)
            st.reset()
        self.inputs = self.labels = None
        return RunResult(losses, outputs, self.peak, events)

    def _begin(self, inputs: dict[int, tuple], labels: dict[int, tuple], criterion: Callable | None,
               forward_only: bool, keep_outputs: bool, checks: Sequence[int]) -> None:
        """Reset the per-step state, start the step-start agreement and let each stage's sync prepare."""
        for st in self.stages.values():
            st.reset()
        self.store.clear()
        self.inputs, self.labels, self.criterion = inputs, labels, criterion
        self.training, self.keep_outputs = not forward_only, keep_outputs
        self.live = self.peak = 0
        p2p = self.p2p
        p2p.recvs.clear()
        p2p.sends.clear()
        signature = (self.program.schedule.num_microbatches,
                     tuple((m, tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else None
                                     for t in xs)) for m, xs in sorted(inputs.items())))
        p2p.set_shape(self._tag_shape[0], self._tag_shape[1])
        p2p.begin_step(signature, checks)  # settled by the first post: compute before it overlaps the agreement
        self.plan(forward_only)  # an invalid program fails before any sync prepares
        if self.training:
            for sync in self.syncs.values():
                sync.begin_step()

    def _reduce(self, e: PlannedReduce, events: list[TimelineEvent] | None) -> None:
        """REDUCE_GRAD: post the stage's reduction; recorded on the comm lane (its end set at ``wait``)."""
        start = time.time()
        e.sync.start()
        if events is not None:
            op = e.op
            events.append(TimelineEvent(self.rank, op.kind, op.chain, op.stage, op.mb, start, time.time(), None,
                                        "comm"))

    def _wait_syncs(self, events: list[TimelineEvent] | None) -> None:
        """Complete every stage's reduction posted at its REDUCE_GRAD (in posting order) before the step returns.

        The recorded REDUCE_GRAD events are stretched to when the reduction was complete, so the
        timeline shows each post's comm lane against the rank's later compute.
        """
        done: dict[tuple[int, int], float] = {}
        for key, sync in self.syncs.items():
            sync.wait()
            done[key] = time.time()
        if events:
            for i, ev in enumerate(events):
                if ev.lane == "comm" and (ev.chain, ev.stage) in done:
                    events[i] = ev._replace(end=max(ev.end, done[ev.chain, ev.stage]))

    # ----- instructions ---------------------------------------------------------------------------
    def _post(self, e: PlannedPost) -> None:
        sends, recvs = [], []
        idx = e.index
        for pc in e.comms:
            c, st, sig = pc.op, pc.stage, pc.sends
            if sig is None:
                recvs.append((c, pc.key))
            elif sig is ACT:
                outs = st.outputs.get(c.mb)
                if outs is None:
                    raise PipelineError(f"{self.rank_name}: instruction {idx} {c} sends the output of "
                                        f"F(c{c.chain},s{c.stage},m{c.mb}), which has not run yet")
                sends.append((c, pc.key, outs, st.free_after_send.pop(c.mb, ())))
            else:
                grads = st.input_grads.pop(c.mb, None)
                if grads is None:
                    raise PipelineError(f"{self.rank_name}: instruction {idx} {c} sends the input gradients of "
                                        f"B(c{c.chain},s{c.stage},m{c.mb}), which has not run yet")
                sends.append((c, pc.key, grads, ()))
        self.p2p.post((idx, e.batch), sends, recvs)

    def _step_inputs(self, op: Op) -> Sequence[Any]:
        got = self.inputs.get(op.mb)
        if got is None:
            raise PipelineError(f"{self.rank_name}: {op} starts chain {op.chain} but this rank got no inputs for "
                                f"micro-batch {op.mb}; pass the inputs on the rank that holds the chain's first stage")
        return got

    def _handed_over(self, prev: Stage, mb: int) -> Sequence[Any]:
        """The turn of a V: the previous stage's outputs, as fresh autograd leaves when training."""
        outs = prev.outputs[mb]
        prev.free_after_send.pop(mb, None)  # nothing is sent: kept there, the output (and its graph) outlived W
        if not self.training:
            return outs
        return tuple(o.detach().requires_grad_(o.is_floating_point() or o.is_complex()) for o in outs)

    def _labels(self, st: Stage, mb: int) -> tuple:
        return self.labels.get(mb, ()) if st.is_last else ()

    def _forward(self, st: Stage, mb: int, inputs: Sequence[Any]) -> None:
        st.forward(mb, inputs, self.criterion if st.is_last else None, self._labels(st, mb), self.training,
                   self.keep_outputs)
        self._note_forward(st, mb, inputs)

    def _backward(self, e: PlannedOp, grads: Any) -> None:
        if e.kind is B:
            e.stage.backward(e.op.mb, grads, split=True)
        else:
            e.stage.backward(e.op.mb, grads, split=False)
            self.live -= 1

    def _note_forward(self, st: Stage, mb: int, inputs: Sequence[Any]) -> None:
        if not st.is_last:
            st.free_after_send[mb] = [o for o in st.outputs[mb] if _releasable(o, inputs, self.training)]
        self.live += 1
        if self.live > self.peak:
            self.peak = self.live

    def _split_b(self, e: PlannedOp) -> float:
        """A split B; returns when its compute started (after its output gradients arrived)."""
        grads = e.fetch()
        start = time.time()
        e.stage.backward(e.op.mb, grads, True)
        if self.recorder is not None:  # the recomputed tensors W keeps are known once B is done
            self.recorder.settle()
        return start

    def _fb(self, e: PlannedFB) -> float:
        """An F&B unit, then (recording activation bytes) what its B left for W is counted."""
        start = self._fb_unit(e)
        if self.recorder is not None:
            self.recorder.settle()
        return start

    def _fb_unit(self, e: PlannedFB) -> float:
        """An F&B unit: the stage class's ``overlapped_forward_backward`` if it has one; else F and B as two
        sides handing over at the stages' overlap points (``overlap.py``) once any module has one; else F then B.

        Returns when its compute started (after both halves' inputs arrived).
        """
        f, b = e.f, e.b
        inputs0 = f.fetch()
        grads1 = b.fetch()
        start = time.time()
        if e.overlapped is None or not overlap_enabled():
            if not overlap_wanted():  # nothing in this process communicates mid-stage: F then B
                self._forward(f.stage, f.op.mb, inputs0)
                self._backward(b, grads1)
                return start
            st = f.stage
            run_overlapped(lambda: st.forward(f.op.mb, inputs0, self.criterion if st.is_last else None,
                                              self._labels(st, f.op.mb), self.training, self.keep_outputs),
                           lambda: b.stage.backward(b.op.mb, grads1, split=b.kind is B))
            self._note_forward(st, f.op.mb, inputs0)  # the bookkeeping in F-then-B order
            if b.kind is not B:
                self.live -= 1
            return start
        sf, sb, mf, mb = f.stage, b.stage, f.op.mb, b.op.mb
        criterion0 = self.criterion if sf.is_last else None
        labels0 = self._labels(sf, mf)
        split = b.kind is B
        loss1, outputs1, output_grads1 = sb.overlapped_roots(mb, grads1)
        with sb.backward_context(mb, split), sf.forward_context(mf, split):
            outputs0, loss0 = e.overlapped(sf.module, list(inputs0), criterion0, list(labels0) if criterion0 else [],
                                           sb.module, loss1, outputs1, output_grads1)
        sf.finish_forward(mf, inputs0, outputs0, loss0, criterion0, labels0, True, self.keep_outputs)
        self._note_forward(sf, mf, inputs0)
        sb.finish_overlapped_backward(mb, split)
        if not split:
            self.live -= 1
        return start
