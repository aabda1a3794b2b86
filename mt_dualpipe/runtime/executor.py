"""The executor: one loop over one rank's ``Program``, dispatching on the instruction kind.

There is no schedule-specific code here. F takes its inputs from the step's micro-batch (first
stage), from the same rank (the turn of a V placement: handed over locally) or from a posted
receive, waited for right before F; B/BW takes its output gradients the same way. A ``CommBatch``
is posted at once and never waited for; sends complete in the background and their outputs'
storage is released once they have. Peak live activations follow the simulator's rule (+1 at F,
-1 at W or BW), so the recorded peak can be compared with ``simulate()``.

Per step the loop only dispatches: what an instruction needs (its stage, where its inputs or
output grads come from, each comm op's message key) is resolved once per program into a plan
(``Executor.plan``), so the Python cost per instruction is a tuple unpack and a call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..schedules.ir import FB, CommBatch, Op, Program
from ..schedules.timeline import TimelineEvent
from .backward import backward_roots
from .comm import P2P, message_key
from .errors import PipelineError
from .stage import Stage
from .weight_grad import WeightGradStore


def _releasable(t: torch.Tensor, inputs: Sequence[Any], training: bool) -> bool:
    """Whether a sent output's storage may be dropped: not a view, not an input, not saved by its own node."""
    if t._base is not None or any(t is x for x in inputs):
        return False
    if training:
        return t.grad_fn is not None and not hasattr(t.grad_fn, "_saved_result")
    return True


_FETCH = object()  # "take the output grads from the program" (None is a valid value: a last stage)
_LAST = object()  # plan: a chain's last stage (B starts from the loss, no output grads)
# plan codes (compared with ``is``: small ints are shared objects)
_POST, _F, _B, _BW, _W, _FB = range(6)
_SEND_F, _SEND_B, _RECV = range(3)


class StepResult:
    __slots__ = ("losses", "outputs", "peak_activations", "events")

    def __init__(self, losses, outputs, peak, events):
        self.losses, self.outputs, self.peak_activations, self.events = losses, outputs, peak, events


class Executor:
    """Runs the program of ``rank`` with this rank's stage modules (in ``local_stages`` order)."""

    def __init__(self, program: Program, rank: int, modules: Sequence[nn.Module], p2p: P2P,
                 store: WeightGradStore):
        sched = program.schedule
        self.program, self.rank, self.p2p, self.store = program, rank, p2p, store
        self.placement = sched.placement
        local = sched.local_stages(rank)
        if len(local) != len(modules):
            raise PipelineError(
                f"rank {rank} runs {len(local)} stage(s) {local} of schedule {sched.name!r} but was given "
                f"{len(modules)} module(s); pass one module per stage, in (chain, stage) order")
        self.stages = {(c, s): Stage(m, c, s, s == 0, s == len(self.placement[c]) - 1, store, rank=rank)
                       for (c, s), m in zip(local, modules)}
        self._programs: dict[bool, list[tuple[int, Any]]] = {}
        self._plans: dict[bool, list[tuple]] = {}
        self._tag_shape = (len(self.placement), max(len(c) for c in self.placement))

    def instructions(self, forward_only: bool) -> list[tuple[int, Any]]:
        """(index in the program, instruction); forward-only drops backward ops and their messages."""
        if forward_only not in self._programs:
            out = []
            for i, ins in enumerate(self.program.ranks[self.rank]):
                if not forward_only:
                    out.append((i, ins))
                elif type(ins) is CommBatch:
                    ops = tuple(c for c in ins.ops if c.kind in ("SEND_F", "RECV_F"))
                    if ops:
                        out.append((i, CommBatch(ops)))
                elif type(ins) is FB:
                    out.append((i, ins.f))
                elif ins.kind == "F":
                    out.append((i, ins))
            self._programs[forward_only] = out
        return self._programs[forward_only]

    def plan(self, forward_only: bool) -> list[tuple]:
        """The instructions with everything a step would look up per op resolved once per program.

        Each entry is ``(code, index, instruction, a, b)``: for F, ``a`` is the stage and ``b`` where
        its inputs come from (None: the step's micro-batch; a ``Stage``: handed over locally at the
        turn of a V; a message key: a receive); for B/BW likewise the output grads (``_LAST`` for a
        chain's last stage); for W ``a`` is the stage; for a ``CommBatch`` ``a`` is one
        ``(kind, comm, stage, key)`` per comm op. Built on first use, so an invalid program fails
        in the step that first runs it, with the same errors as before.
        """
        if forward_only not in self._plans:
            self._plans[forward_only] = [self._plan_one(i, ins) for i, ins in self.instructions(forward_only)]
        return self._plans[forward_only]

    def _plan_one(self, idx: int, ins: Any) -> tuple:
        t = type(ins)
        if t is CommBatch:
            comms = []
            for c in ins.ops:
                st = self.stages.get((c.chain, c.stage))
                if st is None:
                    raise PipelineError(f"rank {self.rank}: instruction {idx} {c} names a stage this rank does "
                                        "not run")
                kind = _SEND_F if c.kind == "SEND_F" else _SEND_B if c.kind == "SEND_B" else _RECV
                comms.append((kind, c, st, message_key(c.kind, c.chain, c.stage, c.mb)))
            return (_POST, idx, ins, tuple(comms), None)
        if t is FB:
            return (_FB, idx, ins, None, None)
        st = self.stages.get((ins.chain, ins.stage))
        if st is None:
            raise PipelineError(f"rank {self.rank}: instruction {idx} {ins} names a stage this rank does not run")
        c, s, m = ins.chain, ins.stage, ins.mb
        if ins.kind == "F":
            src = None if s == 0 else self.stages[c, s - 1] if self.placement[c][s - 1] == self.rank \
                else ("F", c, s - 1, m)
            return (_F, idx, ins, st, src)
        if ins.kind == "W":
            return (_W, idx, ins, st, None)
        src = _LAST if st.is_last else self.stages[c, s + 1] if self.placement[c][s + 1] == self.rank \
            else ("B", c, s + 1, m)
        return (_B if ins.kind == "B" else _BW, idx, ins, st, src)

    # ----- one step -----------------------------------------------------------------------------
    def run(self, inputs: dict[int, tuple], labels: dict[int, tuple], criterion: Callable | None,
            forward_only: bool, keep_outputs: bool, record: bool) -> StepResult:
        for st in self.stages.values():
            st.reset()
        self.store.clear()
        self.inputs, self.labels, self.criterion = inputs, labels, criterion
        self.training, self.keep_outputs = not forward_only, keep_outputs
        self.live = self.peak = 0
        events: list[TimelineEvent] | None = [] if record else None
        p2p = self.p2p
        p2p.recvs.clear()
        p2p.sends.clear()
        signature = (self.program.schedule.num_microbatches,
                     tuple((m, tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else None
                                     for t in xs)) for m, xs in sorted(inputs.items())))
        p2p.set_shape(self._tag_shape[0], self._tag_shape[1])
        p2p.begin_step(signature)  # settled by the first post: compute before it overlaps the agreement
        clock = time.time
        training, take, rank = self.training, p2p.take, self.rank
        for code, idx, ins, a, b in self.plan(forward_only):
            if code is _POST:
                self._post(idx, ins, a)
                continue
            if code is _F:
                if b is None:
                    got = self._step_inputs(ins)
                elif type(b) is tuple:
                    got = take(b, (idx, ins), training)
                else:
                    got = self._handed_over(b, ins.mb)
                start = clock()
                self._run_forward(a, ins.mb, got)
            elif code is _W:
                start = clock()
                a.weight(ins.mb)
                self.live -= 1
            elif code is _FB:
                start = self._fb(idx, ins)
            else:
                if b is _LAST:
                    grads = None
                elif type(b) is tuple:
                    grads = take(b, (idx, ins), False)
                else:
                    grads = b.input_grads.pop(ins.mb)
                start = clock()
                if code is _B:
                    a.backward(ins.mb, grads, split=True)
                else:
                    a.backward(ins.mb, grads, split=False)
                    self.live -= 1
            if record:
                end = clock()
                if code is _FB:
                    f, bk = ins.f, ins.b
                    events.append(TimelineEvent(rank, "FB", f.chain, f.stage, f.mb, start, end,
                                                (bk.kind, bk.chain, bk.stage, bk.mb)))
                else:
                    events.append(TimelineEvent(rank, ins.kind, ins.chain, ins.stage, ins.mb, start, end))
        p2p.finish((len(self.program.ranks[self.rank]), "end of step"))
        if len(self.store):
            raise PipelineError(f"rank {self.rank}: the step ended with {len(self.store)} deferred weight-gradient "
                                "group(s) that no W ran")
        losses, outputs = {}, {}
        for st in self.stages.values():
            if st.is_last:
                losses.update(st.losses)
                if keep_outputs:
                    outputs.update(st.outputs)
            st.reset()
        self.inputs = self.labels = None
        return StepResult(losses, outputs, self.peak, events)

    # ----- instructions ---------------------------------------------------------------------------
    def _post(self, idx: int, batch: CommBatch, comms: Sequence[tuple]) -> None:
        sends, recvs = [], []
        for kind, c, st, key in comms:
            if kind is _SEND_F:
                outs = st.outputs.get(c.mb)
                if outs is None:
                    raise PipelineError(f"rank {self.rank}: instruction {idx} {c} sends the output of "
                                        f"F(c{c.chain},s{c.stage},m{c.mb}), which has not run yet")
                sends.append((c, key, outs, st.free_after_send.pop(c.mb, ())))
            elif kind is _SEND_B:
                grads = st.input_grads.pop(c.mb, None)
                if grads is None:
                    raise PipelineError(f"rank {self.rank}: instruction {idx} {c} sends the input gradients of "
                                        f"B(c{c.chain},s{c.stage},m{c.mb}), which has not run yet")
                sends.append((c, key, grads, ()))
            else:
                recvs.append((c, key))
        self.p2p.post((idx, batch), sends, recvs)

    def _step_inputs(self, op: Op) -> Sequence[Any]:
        got = self.inputs.get(op.mb)
        if got is None:
            raise PipelineError(f"rank {self.rank}: {op} starts chain {op.chain} but this rank got no inputs for "
                                f"micro-batch {op.mb}; pass the inputs on the rank that holds the chain's first stage")
        return got

    def _handed_over(self, prev: Stage, mb: int) -> Sequence[Any]:
        """The turn of a V: the previous stage's outputs, as fresh autograd leaves when training."""
        outs = prev.outputs[mb]
        if not self.training:
            return outs
        return tuple(o.detach().requires_grad_(o.is_floating_point() or o.is_complex()) for o in outs)

    def _run_forward(self, st: Stage, mb: int, inputs: Sequence[Any]) -> None:
        st.forward(mb, inputs, self.criterion if st.is_last else None, self._labels(st, mb), self.training,
                   self.keep_outputs)
        self._note_forward(st, mb, inputs)

    def _forward_inputs(self, idx: int, op: Op) -> Sequence[Any]:
        c, s, m = op.chain, op.stage, op.mb
        if s == 0:
            return self._step_inputs(op)
        if self.placement[c][s - 1] == self.rank:  # the turn of a V: handed over locally
            return self._handed_over(self.stages[c, s - 1], m)
        return self.p2p.take(("F", c, s - 1, m), (idx, op), self.training)

    def _output_grads(self, idx: int, op: Op, st: Stage) -> Sequence[Any] | None:
        c, s, m = op.chain, op.stage, op.mb
        if st.is_last:
            return None
        if self.placement[c][s + 1] == self.rank:
            return self.stages[c, s + 1].input_grads.pop(m)
        return self.p2p.take(("B", c, s + 1, m), (idx, op), False)

    def _labels(self, st: Stage, mb: int) -> tuple:
        return self.labels.get(mb, ()) if st.is_last else ()

    def _forward(self, idx: int, op: Op, inputs: Sequence[Any] | None = None) -> float:
        """F; returns when its compute started (after waiting for its inputs)."""
        st = self.stages[op.chain, op.stage]
        if inputs is None:
            inputs = self._forward_inputs(idx, op)
        start = time.time()
        st.forward(op.mb, inputs, self.criterion if st.is_last else None, self._labels(st, op.mb), self.training,
                   self.keep_outputs)
        self._note_forward(st, op.mb, inputs)
        return start

    def _note_forward(self, st: Stage, mb: int, inputs: Sequence[Any]) -> None:
        if not st.is_last:
            st.free_after_send[mb] = [o for o in st.outputs[mb] if _releasable(o, inputs, self.training)]
        self.live += 1
        if self.live > self.peak:
            self.peak = self.live

    def _backward(self, idx: int, op: Op, grads: Any = _FETCH) -> float:
        """B or BW; returns when its compute started (after waiting for its output grads)."""
        st = self.stages[op.chain, op.stage]
        if grads is _FETCH:
            grads = self._output_grads(idx, op, st)
        start = time.time()
        st.backward(op.mb, grads, split=op.kind == "B")
        if op.kind == "BW":
            self.live -= 1
        return start

    def _fb(self, idx: int, item: FB) -> float:
        """An F&B unit: the stage class's ``overlapped_forward_backward`` if it has one, else F then B."""
        f, b = item.f, item.b
        sf, sb = self.stages[f.chain, f.stage], self.stages[b.chain, b.stage]
        cls = type(sf.module)
        inputs0 = self._forward_inputs(idx, f)
        grads1 = self._output_grads(idx, b, sb)
        if cls is not type(sb.module) or not hasattr(cls, "overlapped_forward_backward"):
            start = self._forward(idx, f, inputs0)
            self._backward(idx, b, grads1)
            return start
        start = time.time()
        if sb.is_last:
            loss1, outputs1, output_grads1 = sb.losses[b.mb], [], []
        else:
            loss1 = None
            outputs1, output_grads1 = backward_roots(sb.outputs[b.mb], grads1)
        split = b.kind == "B"
        defer = self.store.deferring((b.chain, b.stage, b.mb)) if split else contextlib.nullcontext()
        criterion0 = self.criterion if sf.is_last else None
        with defer:
            outputs0, loss0 = cls.overlapped_forward_backward(
                sf.module, list(inputs0), criterion0, list(self._labels(sf, f.mb)) if criterion0 else [],
                sb.module, loss1, outputs1, output_grads1)
        sf.finish_forward(f.mb, inputs0, outputs0, loss0, criterion0, self._labels(sf, f.mb), True,
                          self.keep_outputs)
        self._note_forward(sf, f.mb, inputs0)
        input_grads1 = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                        for x in sb.inputs[b.mb]]
        if split:
            sb.pending_w[b.mb] = "store"
        sb.after_backward(b.mb, input_grads1, split)
        if not split:
            self.live -= 1
        return start
