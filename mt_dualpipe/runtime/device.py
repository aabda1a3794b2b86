"""Device and backend selection: cpu -> gloo, cuda -> nccl, musa -> mccl.

The runtime never hard-codes a device. It reads the device of the stage modules' parameters and
picks the point-to-point backend that fits it; ``torch_musa`` is imported only when present. On an
accelerator, communication runs on its own stream and is ordered against compute with events, so a
send posted after a compute op starts only when that op's kernels are done, and a compute op that
consumes a receive waits only for that receive.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "musa": "mccl"}


def try_import_musa() -> bool:
    """Import ``torch_musa`` if it is installed (it registers the ``musa`` device); never required."""
    if hasattr(torch, "musa"):
        return True
    try:
        importlib.import_module("torch_musa")
    except ImportError:
        return False
    return hasattr(torch, "musa")


def module_device(modules: Iterable[nn.Module]) -> torch.device:
    """The device of the first parameter or buffer of ``modules`` (cpu when they have none)."""
    for m in modules:
        for t in m.parameters():
            return t.device
        for t in m.buffers():
            return t.device
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """The point-to-point backend for ``device``: gloo on cpu, nccl on cuda, mccl on musa."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "musa":
        try_import_musa()
    if kind not in BACKENDS:
        raise ValueError(f"no point-to-point backend for device type {kind!r}; supported: {', '.join(BACKENDS)}")
    return BACKENDS[kind]


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
