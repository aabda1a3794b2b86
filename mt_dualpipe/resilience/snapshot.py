"""In-memory snapshots: everything a rank needs to return to an earlier step bit-exactly.

A snapshot holds copies (never views) of the local modules' state dicts, the optimizer's state,
any extra stateful objects (lr schedulers, grad scalers), the random number generators and the
data position. The tensors are packed into one flat buffer per dtype (on the CPU by default: a
snapshot costs host memory, not device memory), and a small *skeleton* keeps the structure, the
non-tensor values and where each tensor lives in the buffers. Packing makes a snapshot a few large
copies instead of one small allocation per tensor, and lets a checkpoint write a handful of
buffers instead of thousands of tensors.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

np: Any
try:  # numpy is optional for the library; its generator is captured when present
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed in CI
    np = None


def _accelerator_modules() -> list[tuple[str, Any]]:
    mods = []
    for name in ("cuda", "musa"):
        mod = getattr(torch, name, None)
        if mod is not None and hasattr(mod, "is_available") and mod.is_available():
            mods.append((name, mod))
    return mods


def capture_rng() -> dict[str, Any]:
    """The state of every generator training may draw from: python, numpy, torch cpu and accelerators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    for name, mod in _accelerator_modules():
        state[name] = mod.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put the generators back to ``state`` (from ``capture_rng``)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    for name, mod in _accelerator_modules():
        if name in state:
            mod.set_rng_state_all(state[name])


# ----- skeletons: nested structures with their tensors taken out --------------------------------
@dataclass(frozen=True)
class DTensorSpec:
    """How to rebuild a sharded ``DTensor`` around its local part: mesh, placements, global shape/stride."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:

        return DTensor.from_local(local, self.mesh, list(self.placements), run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor taken out of a nested structure lives: ``buffer[offset: offset + numel]``.

    A ``DTensor`` (ZeRO-1 optimizer state, FSDP2 parameters) is stored by its local part only —
    what this rank holds — with ``dtensor`` saying how to wrap it again.
    """

    buffer: str
    offset: int
    shape: tuple[int, ...]
    dtensor: DTensorSpec | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _is_seq(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and not hasattr(v, "_fields")


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _map(value: Any, fn, leaf=None) -> Any:
    """Rebuild ``value`` with ``fn`` applied to its tensors / TensorRefs (dicts, lists, tuples) and
    ``leaf`` (default: keep) to every other mutable leaf."""
    if isinstance(value, (torch.Tensor, TensorRef)):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map(v, fn, leaf)) for k, v in value.items())
    if _is_seq(value):
        return type(value)(_map(v, fn, leaf) for v in value)
    if leaf is not None and not isinstance(value, _IMMUTABLE):
        return leaf(value)
    return value


def tensor_refs(skeleton: Any) -> Iterable[TensorRef]:
    """Every ``TensorRef`` in a skeleton."""
    if isinstance(skeleton, TensorRef):
        yield skeleton
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            yield from tensor_refs(v)
    elif _is_seq(skeleton):
        for v in skeleton:
            yield from tensor_refs(v)


def buffer_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def pack(value: Any, device: torch.device | str | None = "cpu",
         reuse: dict[str, torch.Tensor] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """Copy every tensor of ``value`` into one flat buffer per dtype; returns (skeleton, buffers).

    ``device``: where the buffers live (None: the device of the first tensor of each dtype).
    ``reuse``: buffers of a discarded snapshot to write into when they fit (a fresh allocation costs
    more than the copy itself: its pages are touched for the first time). The skeleton holds fresh
    containers and copies of mutable leaves, so later changes to ``value`` do not reach it.
    """
    groups: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def take(t: torch.Tensor) -> TensorRef:
        t = t.detach()
        spec = None
        if isinstance(t, DTensor):
            spec = DTensorSpec(t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()))
            t = t.to_local()
        name = buffer_name(t.dtype)
        off = sizes.get(name, 0)
        groups.setdefault(name, []).append(t)
        sizes[name] = off + t.numel()
        return TensorRef(name, off, tuple(t.shape), spec)

    skeleton = _map(value, take, leaf=copy.deepcopy)
    buffers: dict[str, torch.Tensor] = {}
    synced = False
    for name, ts in groups.items():
        target = torch.device(device) if device is not None else ts[0].device
        old = (reuse or {}).get(name)
        dest = old if old is not None and old.numel() == sizes[name] and old.device == target else None
        if all(t.device == target for t in ts):
            flat = [t.reshape(-1) for t in ts]
            buffers[name] = torch.cat(flat) if dest is None else torch.cat(flat, out=dest)
            continue
        if dest is None:
            pin = target.type == "cpu" and torch.cuda.is_available()
            dest = torch.empty(sizes[name], dtype=ts[0].dtype, device=target, pin_memory=pin)
        off = 0
        for t in ts:
            dest[off: off + t.numel()].copy_(t.reshape(-1), non_blocking=True)
            off += t.numel()
        buffers[name] = dest
        synced = True
    if synced:  # device-to-host copies must land before the live tensors change
        for _, mod in _accelerator_modules():
            mod.synchronize()
    return skeleton, buffers


def unpack(skeleton: Any, buffers: dict[str, torch.Tensor]) -> Any:
    """The structure of ``skeleton`` with views into ``buffers`` for its tensors (no copy); a
    ``DTensor`` comes back as a ``DTensor`` around its view."""
    def view(r: TensorRef) -> torch.Tensor:
        local = buffers[r.buffer][r.offset: r.offset + r.numel].view(r.shape)
        return r.dtensor.wrap(local) if r.dtensor is not None else local

    return _map(skeleton, view)


def _copy_tensors(value: Any) -> Any:
    return _map(value, lambda t: t.clone())


# ----- snapshots --------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """The state of one rank after ``step`` optimizer steps, about to read data ``position``.

    ``skeleton`` is the payload dict (modules, optimizer, stateful, rng, extra) with TensorRefs;
    ``buffers`` hold the tensors. The snapshot is immutable: restoring copies out of it.
    """

    step: int
    position: int
    skeleton: dict[str, Any]
    buffers: dict[str, torch.Tensor]

    def payload(self) -> dict[str, Any]:
        """The nested state with tensor views into the buffers (read-only use)."""
        return unpack(self.skeleton, self.buffers)

    @property
    def modules(self) -> list[dict[str, torch.Tensor]]:
        return self.payload()["modules"]

    @property
    def optimizer(self) -> dict[str, Any] | None:
        return self.payload()["optimizer"]

    @property
    def rng(self) -> dict[str, Any]:
        return self.payload()["rng"]

    @property
    def extra(self) -> dict[str, Any]:
        return self.skeleton["extra"]

    def nbytes(self) -> int:
        """Bytes of tensor data this snapshot holds."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def take_snapshot(step: int, position: int, modules: Sequence[nn.Module], optimizer: Any | None,
                  stateful: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                  device: torch.device | str | None = "cpu", reuse: Snapshot | None = None) -> Snapshot:
    """Copy the state of ``modules``, ``optimizer``, ``stateful`` objects and the RNGs.

    ``device`` is where the copies live ("cpu" by default; None keeps each dtype on its device).
    ``extra`` (plain python values) is stored deep-copied. ``reuse``: a snapshot that is no longer
    needed, whose buffers are overwritten when they fit (it must not be used afterwards).
    """
    payload = {"modules": [m.state_dict() for m in modules],
               "optimizer": optimizer.state_dict() if optimizer is not None else None,
               "stateful": {k: obj.state_dict() for k, obj in (stateful or {}).items()},
               "rng": capture_rng(), "extra": dict(extra or {})}
    skeleton, buffers = pack(payload, device, reuse.buffers if reuse is not None else None)
    return Snapshot(step, position, skeleton, buffers)


def restore_snapshot(snap: Snapshot, modules: Sequence[nn.Module], optimizer: Any | None,
                     stateful: dict[str, Any] | None = None) -> None:
    """Copy ``snap`` back into the live objects; the snapshot itself stays untouched (reusable)."""
    payload = snap.payload()
    if len(payload["modules"]) != len(modules):
        raise ValueError(f"the snapshot holds {len(payload['modules'])} modules but {len(modules)} were given")
    for state, m in zip(payload["modules"], modules):
        m.load_state_dict(state)  # copies into the live parameters and buffers
    if optimizer is not None and payload["optimizer"] is not None:
        # load_state_dict may keep the given tensors as the optimizer's state: hand it copies
        optimizer.load_state_dict(_copy_tensors(payload["optimizer"]))
    for k, obj in (stateful or {}).items():
        obj.load_state_dict(_copy_tensors(payload["stateful"][k]))
    restore_rng(_copy_tensors(payload["rng"]))
