"""Activation checkpointing under the B/W split: each checkpointed region recomputed once, in B.

A non-reentrant ``torch.utils.checkpoint`` (and everything built on it: ``checkpoint_wrapper``,
selective op-level AC with ``create_selective_checkpoint_contexts``) saves a *holder* instead of
each tensor, and re-runs its region the first time a backward call unpacks one. Its bookkeeping
is per backward call: a ``GraphExecGroup`` can make several calls count as one, but each saved
tensor may be unpacked only once per group, after which the recomputed tensor is released.

The generic split runs one engine call for B and one per frontier node in W, and W re-runs the
frontier nodes, which unpack the same saved tensors B's run of them unpacked (a linear's input is
needed by both its input- and weight-gradient). Left alone, every W call recomputes the region
again: a block's forward runs 2.5 times per micro-batch instead of twice. Here B and W of one
micro-batch share one group (``SharedRecompute``), and while B runs a frontier node, the tensors
it unpacks are kept (their handle stays in the holder) for W's re-run of the same node, which
then releases them. So the region is recomputed once, in B; between B and W only the frontier
nodes' saved tensors (a linear's input) stay alive, as without checkpointing.

This reads two private names of ``torch.utils.checkpoint`` (``_Holder`` and ``GraphExecGroup``'s
group id); where they are missing (torch < 2.9) nothing is shared and W recomputes as before
(``supported()``). The holder class is swapped only while a stage's forward runs
(``recording``), and the swapped class behaves as torch's except inside a ``SharedRecompute``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from .activation_bytes import ActivationBytes

_GROUP = getattr(_ckpt, "GraphExecGroup", None)
_HOLDER = getattr(_ckpt, "_Holder", None)


def supported() -> bool:
    """Whether this torch lets B and W share a checkpointed region's recompute."""
    return _GROUP is not None and _HOLDER is not None


class _Handles(dict):
    """A holder's handle per backward group; in a ``SharedRecompute`` B, a frontier node's unpack keeps it."""

    def __setitem__(self, gid: Any, handle: Any) -> None:
        if handle is None and isinstance(gid, SharedRecompute) and gid.keeps():
            return  # W's re-run of the same node unpacks it again, and releases it then
        super().__setitem__(gid, handle)


class _Recorder:
    """Counts the checkpoint holders one stage forward creates (0: no checkpointing, nothing to share)."""

    def __init__(self) -> None:
        self.holders = 0


_recording = threading.local()

if _HOLDER is not None:
    class _SharingHolder(_HOLDER):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.handles = _Handles()
            rec = getattr(_recording, "rec", None)
            if rec is not None:
                rec.holders += 1


@contextmanager
def recording() -> Iterator[_Recorder]:
    """While a stage's forward runs: checkpoint holders are created sharable, and counted."""
    rec = _Recorder()
    if not supported():
        yield rec
        return
    _recording.rec, before = rec, _ckpt._Holder
    _ckpt._Holder = _SharingHolder
    try:
        yield rec
    finally:
        _ckpt._Holder = before
        _recording.rec = None


if _GROUP is not None:
    class SharedRecompute(_GROUP):  # type: ignore[misc, valid-type]
        """The backward group of one micro-batch's B and W (see the module docstring)."""

        def __init__(self) -> None:
            self._keeping = threading.local()

        def keeps(self) -> bool:
            """Whether an unpack happening now is a frontier node's in B (kept for W)."""
            return getattr(self._keeping, "on", False)

        @contextmanager
        def keeping(self, nodes: Sequence[Any]) -> Iterator[None]:
            """B: inside this group, the saved tensors ``nodes`` unpack survive until W re-runs them."""
            def enter(*_: Any) -> None:
                self._keeping.on = True

            def leave(node: Any, *_: Any) -> None:
                recorder = ActivationBytes.active()
                if recorder is not None:  # what this node keeps for W, counted like a recompute policy's
                    for t in _saved_tensors(node):
                        recorder.recomputed(t)
                self._keeping.on = False

            handles = [h for n in nodes
                       for h in (n.register_prehook(enter), n.register_hook(lambda *g, n=n: leave(n, *g)))]
            try:
                with self:
                    yield
            finally:
                self._keeping.on = False
                for h in handles:
                    h.remove()


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    """The tensors ``node`` saved for backward (its ``_saved_*`` attributes; reading one unpacks it, which
    inside ``SharedRecompute.keeping`` keeps it for W)."""
    out = []
    for name in dir(node):
        if name.startswith("_saved_"):
            v = getattr(node, name, None)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


if _GROUP is None:  # pragma: no cover - torch without GraphExecGroup: recording() never marks a stage
    class SharedRecompute:  # type: ignore[no-redef]
        """Unavailable on this torch (``supported()`` is False)."""
