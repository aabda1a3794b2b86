"""Deferred weight gradients: the fast path of the B / W split.

A layer whose backward can hand its weight-gradient GEMM to later (``W``) checks for an active
store inside its autograd ``backward``::

    store = WeightGradStore.active()
    if store is not None:
        store.put(lambda: weight.grad_accumulate(grad_out.t() @ x))   # runs at W
    else:
        ...compute the weight gradient now...

and declares ``supports_deferred_weight_grad = True`` on the module class, so the runtime knows
that B of a stage made only of such layers (and parameter-free modules) leaves nothing but the
queued closures for W.

Stores are per pipeline, not global state: the runtime activates its own store only while it
runs a B (``with store.deferring():``), and each B's closures form one group that the matching W
runs (``store.run_oldest()``). Activation is process-wide for the duration of the call, so the
autograd engine's device threads (CUDA/MUSA) see it too.

A forward whose backward the runtime will run fused (BW: no W to defer to) needs no deferring node
at all: while it runs, ``deferrable_forward()`` is False on its thread (``fused_forward``), and a
deferring layer may then build the plain autograd node (``DeferredLinear`` calls ``F.linear``, whose
backward runs in C++, instead of its Python ``autograd.Function``). A layer that ignores it is still
right: with no store active its backward computes the weight gradient at once.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch

from .accumulate import accumulate, add_to_grad, observed, through_engine

_active_lock = threading.Lock()
_active: WeightGradStore | None = None


class _ForwardMode(threading.local):
    """Per thread: whether the forward running on it may have its weight gradients deferred. Thread-local,
    not process-wide: an F&B unit's B side (another thread) may recompute a forward for a split B meanwhile."""

    deferrable = True


_forward_mode = _ForwardMode()


_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def deferrable_forward() -> bool:
    """False while the runtime runs a forward whose backward it will run fused (``fused_forward``), outside
    any saved-tensors hooks. Under such hooks (a non-reentrant checkpoint's region, or its recompute, which
    runs with the fused flag off and must save what the forward saved) deferring layers keep their node."""
    if _forward_mode.deferrable:
        return True
    return _saved_tensors_hooks is None or _saved_tensors_hooks(False) is not None


@contextmanager
def fused_forward() -> Iterator[None]:
    """Run a forward on this thread whose backward will be a fused BW: deferring layers may build plain nodes."""
    before = _forward_mode.deferrable
    _forward_mode.deferrable = False
    try:
        yield
    finally:
        _forward_mode.deferrable = before


class WeightGradStore:
    """A FIFO of weight-gradient groups, one group per deferred B."""

    def __init__(self) -> None:
        self._collecting: list[Callable[[], None]] | None = None
        self._groups: deque[tuple[Hashable, list[Callable[[], None]]]] = deque()
        self.closures_run = 0  # closures run by run_oldest / run since the store was made (W's real work)

    @staticmethod
    def active() -> WeightGradStore | None:
        """The store of the pipeline running a deferred B right now, or None (compute W at once)."""
        return _active

    def put(self, fn: Callable[[], None]) -> None:
        """Queue one weight-gradient computation of the B that is running."""
        if self._collecting is None:
            raise RuntimeError("WeightGradStore.put called outside a deferred B (use WeightGradStore.active())")
        self._collecting.append(fn)

    def put_grads(self, params: Sequence[Any], compute: Callable[[], Sequence[Any]]) -> None:
        """Queue ``compute`` (returning one gradient or None per parameter) to run at W and be
        accumulated into each parameter's ``.grad`` by autograd's own AccumulateGrad (cast to the
        parameter's dtype), so everything that observes accumulation — ``register_post_accumulate_grad_hook``,
        FSDP, optimizers-in-backward — sees W's gradient when W writes it. The GEMMs run without
        grad mode: a ``.grad`` never carries a graph. Neighbouring entries of one W share one engine
        call (``run_group``)."""
        self.put(_Accumulate(params, compute))

    @contextmanager
    def deferring(self, key: Hashable = None) -> Iterator[None]:
        """Run a B with this store active; its closures become one group tagged ``key``."""
        global _active
        with _active_lock:
            if _active is not None:
                raise RuntimeError("another pipeline's deferred B is already running in this process")
            _active = self
        self._collecting = []
        try:
            yield
        finally:
            group, self._collecting = self._collecting, None
            with _active_lock:
                _active = None
        self._groups.append((key, group))

    def run_oldest(self, key: Hashable = None) -> int:
        """Run the oldest group (the W of the oldest deferred B); returns how many closures ran.

        When ``key`` is given it must match the group's key, which catches a W run out of order.
        """
        if not self._groups:
            raise RuntimeError("W requested but no deferred weight gradients are queued")
        got, group = self._groups.popleft()
        if key is not None and got is not None and got != key:
            raise RuntimeError(f"W for {key} but the oldest deferred B is {got}")
        run_group(group)
        self.closures_run += len(group)
        return len(group)

    def run(self, key: Hashable) -> int:
        """Run the group tagged ``key`` (its W, in any order); returns how many closures ran."""
        group = self.pop(key)
        run_group(group)
        self.closures_run += len(group)
        return len(group)

    def pop(self, key: Hashable) -> list[Callable[[], None]]:
        """Remove and return the group tagged ``key`` (W may run out of FIFO order)."""
        for i, (got, group) in enumerate(self._groups):
            if got == key:
                del self._groups[i]
                return group
        raise RuntimeError(f"no deferred weight gradients queued for {key}")

    def queued(self, key: Hashable) -> int:
        """How many closures the group tagged ``key`` holds (0 when there is no such group)."""
        return next((len(group) for got, group in self._groups if got == key), 0)

    def __len__(self) -> int:
        return len(self._groups)

    def clear(self) -> None:
        self._groups.clear()


ACCUMULATE_BATCH_BYTES = 64 << 20
"""Gradient bytes one engine call accumulates at most (what a batch holds beyond ``.grad`` while it runs)."""


class _Accumulate:
    """One ``put_grads`` entry: ``compute`` gives the gradients of ``params``, accumulated by autograd."""

    __slots__ = ("params", "compute")

    def __init__(self, params: Sequence[Any], compute: Callable[[], Sequence[Any]]) -> None:
        self.params, self.compute = params, compute

    def grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with torch.no_grad():
            return self.computed()

    def computed(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``grads`` for a caller already under ``torch.no_grad()``."""
        return [(p, g if g.dtype == p.dtype else g.to(p.dtype)) for p, g in zip(self.params, self.compute())
                if g is not None]

    def __call__(self) -> None:
        through_engine(self.grads())


def accumulate_now(params: Sequence[Any], compute: Callable[[], Sequence[Any]]) -> None:
    """What a queued ``put_grads`` entry does at W, done now (a backward with no store active).

    Called from inside a running backward (``linear_op``), once per layer: a nested engine call there
    would cost more than the GEMM on small layers, so a parameter that nothing observes gets the gradient
    added directly (``accumulate``). Observed parameters still go through the engine.
    """
    pairs = _Accumulate(params, compute).grads()
    with torch.no_grad():
        accumulate(pairs)


def run_group(group: Sequence[Callable[[], None]]) -> None:
    """Run one W's closures in order; ``put_grads`` gradients reach ``.grad`` as AccumulateGrad would put them.

    A parameter that nothing observes and that only one entry of this W names gets its gradient added at once
    (``accumulate.add_to_grad``), so the buffer is free again for the next GEMM. The others go through
    autograd's own AccumulateGrad, neighbours batched into one engine call each (``accumulate.through_engine``):
    there a parameter two entries name gets the sum first, then one accumulation, and its post-accumulate hook
    fires once, as in plain autograd. Batches stop at ``ACCUMULATE_BATCH_BYTES`` of gradients and at any other
    kind of closure, so order and peak memory stay bounded.
    """
    names = Counter(map(id, chain.from_iterable(fn.params for fn in group if type(fn) is _Accumulate)))
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    with torch.no_grad():  # once per W, not per entry (the engine runs AccumulateGrad in its own grad mode)
        for fn in group:
            if type(fn) is not _Accumulate:
                through_engine(pending)
                pending, size = [], 0
                fn()
                continue
            for p, g in fn.computed():
                if names[id(p)] == 1 and not observed(p):
                    add_to_grad(p, g)
                else:
                    pending.append((p, g))
                    size += g.nbytes
            if size >= ACCUMULATE_BATCH_BYTES:
                through_engine(pending)
                pending, size = [], 0
        through_engine(pending)


@contextmanager
def _held(hooked: list[tuple[Any, dict]]) -> Iterator[None]:
    saved = [(hooks, dict(hooks)) for _, hooks in hooked]
    for hooks, _ in saved:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def held_post_accumulate_hooks(params: Sequence[Any]) -> Any:
    """While a B with the store active runs: the post-accumulate-grad hooks of ``params`` hold back.

    Deferring layers return no weight gradient in B, yet autograd still runs their parameters'
    accumulation and would call these hooks with ``.grad`` None (or unchanged). Restricting the
    engine to other targets instead would skip custom autograd Functions that accumulate inside
    their own backward, so the hooks are held for the B (torch keeps them in each parameter's
    ``_post_accumulate_grad_hooks`` dict, emptied and refilled in order here) and fire at W.
    """
    hooked = [(p, h) for p in params if (h := getattr(p, "_post_accumulate_grad_hooks", None))]
    return _held(hooked) if hooked else nullcontext()
