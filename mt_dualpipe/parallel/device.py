"""Device and backend detection: cpu -> gloo, cuda -> nccl, musa -> mccl (``torch_musa`` when installed).

The lowest layer that needs it owns it: the mesh (``mesh.py``) picks its device type and backend
here, and the runtime picks the point-to-point backend for its stage modules' device here. Nothing
hard-codes a device; ``torch_musa`` is imported only when present.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

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


def collective_device(group: object = None) -> torch.device:
    """Where a small host-side tensor must live for a collective on ``group`` (None: the default group).

    cpu where the group has a CPU backend (gloo, or a ``"cpu:gloo,cuda:nccl"`` pair); otherwise this
    process's current accelerator: NCCL and MCCL take device tensors only, and a CPU tensor there fails
    with "No backend type associated with device type cpu".
    """
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    kind = next((k for k, v in BACKENDS.items() if v in backend and k != "cpu"), "cuda")
    if kind == "musa":
        try_import_musa()
    return torch.device(kind, getattr(torch, kind).current_device())
