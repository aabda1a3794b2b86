"""Communication streams on an accelerator: comm ordered against compute with events.

On an accelerator the runtime's communication runs on its own stream, so a send posted after a
compute op starts only when that op's kernels are done, and a compute op that consumes a receive
waits only for that receive. On cpu every method is a no-op. (Which backend a device uses is
``parallel.device``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def _accel(kind: str):
    return getattr(torch, kind, None) if kind != "cpu" else None


class StreamSync:
    """Comm-stream handling. On cpu every method is a no-op; on cuda/musa comm gets its own stream."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        mod = _accel(self.device.type)
        self.active = mod is not None and hasattr(mod, "Stream")
        self._mod = mod
        self.comm_stream = mod.Stream(device=self.device) if self.active else None

    @contextlib.contextmanager
    def comm(self) -> Iterator[None]:
        """Post communication on the comm stream, after the compute issued so far."""
        if not self.active:
            yield
            return
        self.comm_stream.wait_stream(self._mod.current_stream(self.device))
        with self._mod.stream(self.comm_stream):
            yield

    def record(self) -> object | None:
        """An event on the comm stream marking the communication posted so far."""
        if not self.active:
            return None
        ev = self._mod.Event()
        ev.record(self.comm_stream)
        return ev

    def consume(self, event: object | None, tensors: Iterable[torch.Tensor] = ()) -> None:
        """Make compute wait for ``event`` and keep received ``tensors`` alive for the compute stream."""
        if event is None:
            return
        stream = self._mod.current_stream(self.device)
        stream.wait_event(event)
        for t in tensors:
            t.record_stream(stream)
