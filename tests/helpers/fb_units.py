"""Counting the F&B units a pipeline step runs (DualPipe's forward-and-backward pairs), whatever runs them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fb_unit_counter() -> Iterator[list[int]]:
    """A list that gets one entry per F&B unit the executors of this process run while inside.

    Each ``Executor.run`` records its events (whatever the caller asked) and the "FB" ones are counted:
    what ran, read from the executor's own timeline, not from the program it was given.
    """
    from mt_dualpipe.runtime.executor import Executor

    calls: list[int] = []
    plain = Executor.run

    def counted(self, inputs, labels, criterion, forward_only, keep_outputs, record, *args, **kwargs):
        res = plain(self, inputs, labels, criterion, forward_only, keep_outputs, True, *args, **kwargs)
        calls.extend(1 for ev in res.events if ev.op == "FB")
        if not record:
            res.events = None
        return res

    Executor.run = counted
    try:
        yield calls
    finally:
        Executor.run = plain
