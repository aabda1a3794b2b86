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
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

_active_lock = threading.Lock()
_active: WeightGradStore | None = None


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
            return [(p, g.to(p.dtype)) for p, g in zip(self.params, self.compute()) if g is not None]

    def __call__(self) -> None:
        _accumulate(self.grads())


def accumulate_now(params: Sequence[Any], compute: Callable[[], Sequence[Any]]) -> None:
    """What a queued ``put_grads`` entry does at W, done now (a backward with no store active).

    Called from inside a running backward (``linear_op``), once per layer: a nested engine call there
    would cost more than the GEMM on small layers, so a parameter that nothing observes (no tensor
    hook, no post-accumulate hook) gets the gradient added directly, as AccumulateGrad would: stored
    when ``.grad`` is None, added in place otherwise. Observed parameters still go through the engine.
    """
    pairs = _Accumulate(params, compute).grads()
    observed = [(p, g) for p, g in pairs if _hooked(p)]
    with torch.no_grad():
        for p, g in pairs:
            if not _hooked(p):
                if p.grad is None:
                    p.grad = g  # a fresh tensor of this call (no graph: computed under no_grad)
                else:
                    p.grad.add_(g)
    _accumulate(observed)


def _hooked(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def _accumulate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One engine call from the parameters: AccumulateGrad adds each gradient (a parameter listed twice
    gets the sum, and its post-accumulate hook fires once)."""
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


def run_group(group: Sequence[Callable[[], None]]) -> None:
    """Run one W's closures in order, ``put_grads`` neighbours batched into one engine call each.

    An autograd engine call costs far more than a small GEMM (on CUDA it hands over to the device
    thread and back): one per linear made W on a GPU 1.8x slower than the fused backward. Batches
    stop at ``ACCUMULATE_BATCH_BYTES`` of gradients and at any other kind of closure, so order and
    peak memory stay bounded.
    """
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for fn in group:
        if not isinstance(fn, _Accumulate):
            _accumulate(pending)
            pending, size = [], 0
            fn()
            continue
        got = fn.grads()
        pending += got
        size += sum(g.numel() * g.element_size() for _, g in got)
        if size >= ACCUMULATE_BATCH_BYTES:
            _accumulate(pending)
            pending, size = [], 0
    _accumulate(pending)


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
