"""DualPipe's F&B overlap for any stage: one micro-batch's forward runs while another's backward waits on
its communication, and the other way round.

An F&B unit pairs the forward (F) of one micro-batch with the backward (B) of another on the same rank.
Its point is to hide communication that a stage cannot avoid, the MoE all-to-alls above all: while one
side's all-to-all is in flight, the other side computes. The runtime runs the two sides as two threads
that pass one baton: exactly one side runs at any time, and it hands the baton over only at an
**overlap point**, a call that a module makes right after posting an asynchronous collective and before
waiting for it::

    work = dist.all_to_all_single(out, x, recv, send, group=group, async_op=True)
    overlap_point()  # the other side runs while the rows travel
    work.wait()

The F side starts; each side runs until its next overlap point, then the other side runs until its own,
and a side that has finished leaves the baton to the other. The interleaving is therefore the same on
every rank and in every step (collectives of an EP group are posted in the same order by all its
members), and since the two sides share nothing but the parameters, whose gradients only the B side
touches, the result is bit-identical to F followed by B. Outside an F&B unit ``overlap_point()`` does
nothing, so a module calls it unconditionally. The shared layer's expert-parallel dispatch
(``layers/expert_parallel.py``) calls it around each of its all-to-alls, forward and backward, so every
family built on it gets the overlap without code of its own; a user's module marks its own
communication the same way. A stage class may still bring its own ``overlapped_forward_backward``
(deepseek-ai/DualPipe's hook), which the executor then calls instead.

Which side a call belongs to: a call on the B side's thread, or inside the autograd engine's execution
of a node (a backward, or a recompute during one), is the B side; any other call the F side. The second
rule covers CUDA, where the engine runs a backward on its own device thread rather than on the thread
that asked for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

F_SIDE, B_SIDE = 0, 1

_unit: _Baton | None = None  # the F&B unit running in this process (one executor runs one op at a time)
_seen = False  # whether any overlap point was ever reached: the executor threads F&B units only then
_enabled = True  # False inside ``sequential_units()``


def _current_node() -> Any:
    node = getattr(torch._C, "_current_autograd_node", None)
    return node() if node is not None else None


class _Baton:
    """Which side may run; a finished side leaves the baton to the other for good."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = F_SIDE
        self.done = [False, False]
        self.b_thread: int | None = None  # the B side's own thread

    def side_of_caller(self) -> int:
        """The B side on its own thread or inside the autograd engine (CUDA runs a backward on the engine's
        device thread), else the F side."""
        return B_SIDE if threading.get_ident() == self.b_thread or _current_node() is not None else F_SIDE

    def hand_over(self, side: int) -> None:
        """``side`` reached an overlap point: the other side runs until its own, then ``side`` resumes."""
        other = 1 - side
        with self.cond:
            if self.done[other]:
                return
            self.turn = other
            self.cond.notify_all()
            while self.turn != side and not self.done[other]:
                self.cond.wait()

    def wait_turn(self, side: int) -> None:
        with self.cond:
            while self.turn != side and not self.done[1 - side]:
                self.cond.wait()

    def finish(self, side: int) -> None:
        with self.cond:
            self.done[side] = True
            self.turn = 1 - side
            self.cond.notify_all()


def overlap_point() -> None:
    """Let the other side of the running F&B unit run until its next overlap point (a no-op elsewhere).

    Call it after posting an asynchronous collective and before waiting for it."""
    global _seen
    _seen = True
    unit = _unit
    if unit is not None:
        unit.hand_over(unit.side_of_caller())


def overlap_enabled() -> bool:
    """False inside ``sequential_units()``: every F&B unit, a stage class's own hook included, runs F then B."""
    return _enabled


def overlap_wanted() -> bool:
    """Whether the executor runs an F&B unit as two sides: once a module in this process has reached an
    overlap point (a stage with nothing to overlap runs F then B, at no cost), outside ``sequential_units``."""
    return _seen and _enabled


@contextlib.contextmanager
def sequential_units() -> Iterator[None]:
    """F&B units run F then B while inside (no hand-over, no stage class's ``overlapped_forward_backward``
    either): the reference the overlap is measured and tested against (``benchmarks/moe_overlap.py``)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _current_streams() -> list[Any]:
    """The caller's current stream on each initialised accelerator (a thread starts on the default one)."""
    streams = []
    for kind in ("cuda", "musa"):
        mod = getattr(torch, kind, None)
        if mod is not None and getattr(mod, "is_initialized", lambda: False)():
            streams.append((mod, mod.current_stream()))
    return streams


class _Task:
    """One F&B unit's B side: runs on the worker thread on the caller's streams and context variables."""

    def __init__(self, baton: _Baton, fn: Callable[[], Any]) -> None:
        self.baton, self.fn = baton, fn
        self.context = contextvars.copy_context()
        self.streams = _current_streams()
        # OpenMP's thread count is per thread (a new thread gets the machine's default): the B side uses the
        # caller's, so its kernels split their reductions as F then B would, bit for bit, and do not oversubscribe
        self.threads = torch.get_num_threads()
        self.error: BaseException | None = None
        self.done = threading.Event()

    def _call(self) -> None:
        with contextlib.ExitStack() as stack:
            for mod, stream in self.streams:
                stack.enter_context(mod.stream(stream))
            self.fn()

    def run(self) -> None:
        self.baton.b_thread = threading.get_ident()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.baton.wait_turn(B_SIDE)
        try:
            self.context.run(self._call)
        except BaseException as exc:  # re-raised on the caller's thread
            self.error = exc
        finally:
            self.baton.finish(B_SIDE)
            self.done.set()


class _Worker(threading.Thread):
    """The one thread that runs B sides, kept for the process's life: a thread per unit would start each
    backward on a cold thread (a fresh malloc arena whose pages fault in again, the autograd engine's
    per-thread state), which costs more than the unit's own compute on a small model."""

    def __init__(self) -> None:
        super().__init__(name="mt_dualpipe-fb-backward", daemon=True)
        self.tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            self.tasks.get().run()


_worker: _Worker | None = None


def run_overlapped(forward: Callable[[], Any], backward: Callable[[], Any]) -> Any:
    """Run an F&B unit's two sides, handing over at overlap points (see the module docstring); returns what
    ``forward`` returns. An exception of either side is raised here once both have stopped (the forward's
    first), so the other side's collectives are never left half-posted on this rank."""
    global _unit, _worker
    if _unit is not None:
        raise RuntimeError("an F&B unit is already running in this process; units do not nest")
    if _worker is None or not _worker.is_alive():
        _worker = _Worker()
    baton = _Baton()
    task = _Task(baton, backward)
    _unit = baton
    try:
        _worker.tasks.put(task)
        try:
            result = forward()
        finally:
            baton.finish(F_SIDE)
            task.done.wait()
    finally:
        _unit = None
    if task.error is not None:
        raise task.error
    return result
