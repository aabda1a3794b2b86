"""Piecewise forward / backward of a stage, and DualPipe's overlapped F&B built from it.

A stage's forward runs as a sequence of *pieces* (attention+routing, dispatch, experts, combine
per MoE layer; one piece per dense layer or embedding). Pieces are joined by detached leaves and
recorded on a ``Tape``; the stage output is tied to the tape by one autograd function whose
backward replays the pieces' backwards in reverse. Because the backward of a micro-batch is then
an explicit list of steps, ``overlapped_forward_backward`` can interleave the forward pieces of one
micro-batch with the backward pieces of another: each side stops right after posting an
all-to-all, and the other side's computation runs while it is in flight.

Both orders run exactly the same kernels on exactly the same tensors (the two micro-batches share
nothing but the parameters, whose gradients only the backward side touches), so the overlapped
result is bit-identical to forward-then-backward. The criterion of a last stage (head, loss and
MTP) runs as ordinary autograd after the stage's pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from ...layers.expert_parallel import DEFAULT_TIMEOUT, backward_name, ep_size, pack_fp8, post_all_to_all, unpack_fp8

Steps = Generator[None, None, Any]


def _leaf(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.requires_grad:
        return t.detach().requires_grad_()
    return t


def _add_grad(leaf: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    leaf.grad = g if leaf.grad is None else leaf.grad + g


class CaptureSlot:
    """Per-stage switch for the overlapped F&B: while ``sink`` is a list, a backward reaching one of the
    stage's tapes parks (tape, output grads) there instead of running it, so the caller can run that
    tape's backward step by step. Instance state of the stage (not of the module), so stages of two
    pipelines in one process never see each other's capture."""

    def __init__(self) -> None:
        self.sink: list | None = None


class Tape:
    """The pieces of one micro-batch's forward through one stage, kept for the backward."""

    def __init__(self, record: bool = True, slot: CaptureSlot | None = None) -> None:
        self.record = record
        self.slot = slot
        self.entries: list[Any] = []
        self.finals: list[Any] = []
        self.stage_inputs: list[Any] = []
        self.records: list[tuple] | None = []

    # ----- forward -------------------------------------------------------------------------------
    def enter(self, inputs: Sequence[Any]) -> list[Any]:
        self.entries = [_leaf(x) for x in inputs] if self.record else list(inputs)
        return self.entries

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One compute piece; tensors it returns become fresh leaves for the pieces after it."""
        if not self.record:
            return fn(*args)
        with torch.enable_grad():
            out = fn(*args)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        leaves = tuple(_leaf(o) for o in outs)
        pairs = [(o, l) for o, l in zip(outs, leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            self.records.append(("compute", pairs))
        return leaves[0] if single else leaves

    def exchange(self, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Any,
                 what: str = "exchange", timeout: float = DEFAULT_TIMEOUT, fp8: bool = False) -> Callable[[], Any]:
        """Post an all-to-all of ``x``'s rows; the returned callable waits (at most ``timeout`` s) and gives
        the received leaf. ``what`` ("dispatch", "combine") names it in a timeout error. ``fp8``: the rows
        travel as E4M3 + tile scales (``pack_fp8``), their gradient comes back in ``x``'s dtype."""
        if ep_size(group) == 1 and not fp8:
            return lambda: x
        send = pack_fp8(x.detach()) if fp8 else x.detach()
        wait = post_all_to_all(send, out_rows, in_rows, group, what, timeout) if ep_size(group) > 1 else lambda: send

        def done() -> torch.Tensor:
            y = wait()
            if fp8:
                y = unpack_fp8(y, x.shape[1], x.dtype)
            if self.record and x.requires_grad:
                y.requires_grad_()
                self.records.append(("comm", x, y, out_rows, in_rows, group, what, timeout))
            return y

        return done

    # ----- backward ------------------------------------------------------------------------------
    def backward_steps(self, grads: Sequence[torch.Tensor | None]) -> Steps:
        """Replay the pieces' backwards, newest first; yields right after posting each all-to-all.

        Returns the gradients of the stage inputs (None where an input needs none).
        """
        if self.records is None:
            raise RuntimeError("this micro-batch's backward already ran (a stage's backward runs once)")
        for leaf, g in zip(self.finals, grads):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                _add_grad(leaf, g)
        records, self.records = self.records, None
        while records:
            rec = records.pop()
            if rec[0] == "compute":
                roots = [(o, l.grad) for o, l in rec[1] if l.grad is not None]
                if roots:
                    torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
            else:
                _, x, y, out_rows, in_rows, group, what, timeout = rec
                g = y.grad if y.grad is not None else torch.zeros_like(y)
                wait = post_all_to_all(g, in_rows, out_rows, group, backward_name(what), timeout) \
                    if ep_size(group) > 1 else lambda g=g: g
                yield
                _add_grad(x, wait())
        input_grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in self.entries]
        self.entries, self.finals = [], []
        return input_grads


def drive(steps: Steps) -> Any:
    """Run a step generator to the end and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def interleave(a: Steps, b: Steps) -> tuple[Any, Any]:
    """Alternate two step generators (one step of ``a``, one of ``b``, ...); both results."""
    res: list[Any] = [None, None]
    live = [True, True]
    while any(live):
        for i, gen in enumerate((a, b)):
            if live[i]:
                try:
                    next(gen)
                except StopIteration as stop:
                    live[i], res[i] = False, stop.value
    return res[0], res[1]


class TapeFunction(torch.autograd.Function):
    """Ties a stage's outputs to its tape: backward = the tape's backward, all steps at once."""

    @staticmethod
    def forward(ctx, tape: Tape, anchor: torch.Tensor, *inputs: torch.Tensor):
        ctx.tape = tape
        ctx.n_inputs = len(inputs)
        return tuple(f.detach().clone() for f in tape.finals)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        tape, ctx.tape = ctx.tape, None
        slot = tape.slot
        if slot is not None and slot.sink is not None:  # overlapped F&B: stop here, the caller runs it in steps
            slot.sink.append((tape, grads))
            return (None, None) + (None,) * ctx.n_inputs
        return (None, None, *drive(tape.backward_steps(grads)))


def seal(tape: Tape, inputs: Sequence[Any], finals: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The stage outputs: connected to ``inputs`` through the tape (training) or plain (no grad)."""
    if not tape.record:
        return tuple(f.clone() if any(f is x for x in inputs) else f for f in finals)
    tape.finals, tape.stage_inputs = list(finals), list(inputs)
    anchor = torch.empty(0, device=finals[0].device, requires_grad=True)  # outputs need grad even for token ids
    return TapeFunction.apply(tape, anchor, *inputs)


def _tape_of(outputs: Sequence[torch.Tensor]) -> Tape | None:
    for o in outputs:
        tape = getattr(o.grad_fn, "tape", None)
        if isinstance(tape, Tape):
            return tape
    return None


def _push_input_grads(inputs: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> None:
    roots = [(x, g) for x, g in zip(inputs, grads)
             if isinstance(x, torch.Tensor) and x.requires_grad and g is not None]
    if roots:
        torch.autograd.backward([x for x, _ in roots], [g for _, g in roots])


def backward_side(loss1: torch.Tensor | None, outputs1: Sequence[torch.Tensor],
                  output_grads1: Sequence[torch.Tensor], slot: CaptureSlot | None = None) -> Steps | None:
    """The backward of micro-batch 1 as steps, or None when it is not a tape (then run it plainly).
    ``slot``: the capture slot of the stage that produced ``loss1`` (needed when ``loss1`` is given)."""
    if loss1 is not None:
        slot = slot if slot is not None else CaptureSlot()
        slot.sink = []
        try:
            loss1.backward()  # the criterion part (head, loss, MTP); stops at the stage's tape
        finally:
            got, slot.sink = slot.sink, None
        loss1.detach_()
        if not got:  # no tape under this loss: its backward is already complete
            return iter(())
        (tape, grads), = got
        inputs = tape.stage_inputs
    else:
        tape = _tape_of(outputs1)
        if tape is None or tape.records is None:
            return None
        grads, inputs = output_grads1, tape.stage_inputs

    def steps() -> Steps:
        input_grads = yield from tape.backward_steps(grads)
        _push_input_grads(inputs, input_grads)
        tape.stage_inputs = []

    return steps()
