"""The bytes of activations one rank holds for backward during a step, recorded by the runtime itself.

``peak_activations`` counts micro-batches (+1 at F, -1 at W/BW: the simulator's rule); this counts
bytes. While a step runs with recording on, every tensor autograd saves for backward (through
``torch.autograd.graph.saved_tensors_hooks``) has its storage counted from the moment it is saved
until the storage itself is freed: a ``weakref`` callback on the storage (torch keeps a storage's
Python object alive as long as its memory is) removes it. Storage liveness rather than "the graph
let go" is what makes a deferred W count: the zero-bubble B frees the graph, but the queued
weight-gradient closure still holds the linear's input until W runs. A storage is counted once
however many saved views share it; parameters (norm weights autograd references) are not
activations and are left out.

Tensors a ``torch.utils.checkpoint`` region recomputes in B are saved through the checkpoint's own
hooks, not these; the recompute policies (``models/recompute.py``) report the inputs of the
layers that keep them for W (``ActivationBytes.active().recomputed``) while they recompute, and so
does ``checkpoint_reuse`` for the tensors B keeps for W out of a user's checkpointed region. The
executor ``settle``s after each B: those still alive then are what the queued W holds, and are
counted from there until W frees them. Transient recomputed tensors that B consumes and frees are
not counted (no later op holds them), which keeps a fused-backward (BW) schedule's count equal to
the saved tensors of its in-flight micro-batches.

Recording installs saved-tensor hooks for the step, which hide any hooks the caller installed
around ``step()`` (``save_on_cpu`` offloading, a ``SavedActivationMeter``): that is why it is off
unless asked for (``Pipeline.record_activation_bytes``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_active: list[ActivationBytes] = []  # process-wide: a CUDA backward (and its recompute) runs on the engine's threads


class ActivationBytes:
    """Live and peak bytes of the saved (and kept-for-W recomputed) activation storages of one step."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.live = self.peak = 0
        self._params = {p.untyped_storage().data_ptr() for p in parameters}
        self._refs: dict[int, tuple[int, Any]] = {}
        self._candidates: list[Any] = []
        self._lock = threading.Lock()

    @staticmethod
    def active() -> ActivationBytes | None:
        """The recorder of the step running now, or None (recording off)."""
        return _active[-1] if _active else None

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until it is freed (once per storage; parameters and empty storages skipped)."""
        self._count(t.untyped_storage())

    def recomputed(self, t: torch.Tensor) -> None:
        """A tensor recomputed in B that a deferred W may keep: counted at ``settle`` if still alive then."""
        storage = t.untyped_storage()
        if storage.nbytes():
            self._candidates.append(weakref.ref(storage))

    def settle(self) -> None:
        """After a B: count the recomputed tensors still alive (the queued W holds them)."""
        if self._candidates:
            got, self._candidates = self._candidates, []
            for ref in got:
                storage = ref()
                if storage is not None:
                    self._count(storage)

    def _count(self, storage: Any) -> None:
        key = storage.data_ptr()
        if key in self._refs or key in self._params:
            return
        n = storage.nbytes()
        if not n:
            return
        ref = weakref.ref(storage, lambda _, key=key: self._release(key))
        with self._lock:
            self._refs[key] = (n, ref)
            self.live += n
            if self.live > self.peak:
                self.peak = self.live

    def _release(self, key: int) -> None:
        with self._lock:
            got = self._refs.pop(key, None)
            if got is not None:
                self.live -= got[0]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t.untyped_storage())
        # detached: a saved output packed as itself would hold its own grad_fn, a cycle through autograd's
        # C++ nodes that no collector breaks once a split's W keeps the graph (the step would leak)
        return t.detach()

    @contextlib.contextmanager
    def recording(self) -> Iterator[ActivationBytes]:
        """Count what autograd saves on this thread while the block runs (one step)."""
        _active.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _identity):
                yield self
        finally:
            _active.remove(self)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
