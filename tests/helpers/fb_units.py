"""Counting the F&B units a pipeline step runs (DualPipe's forward-and-backward pairs), whatever runs them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fb_unit_counter() -> Iterator[list[int]]:
    """A list that gets one entry per F&B unit the executors of this process run while inside."""
    from mt_dualpipe.runtime.executor import Executor

    calls: list[int] = []
    plain = Executor._fb_unit

    def counted(self, e):
        calls.append(1)
        return plain(self, e)

    Executor._fb_unit = counted
    try:
        yield calls
    finally:
        Executor._fb_unit = plain
