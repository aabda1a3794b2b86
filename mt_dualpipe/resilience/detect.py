"""Local fault detection: non-finite inputs, losses and gradients, and loss spikes.

Each rank judges only what it can see (its inputs, the losses it computed, its local gradients)
and reports a ``FaultKind`` code; ``agree.Agreement`` then combines the ranks' reports so that every
rank takes the same decision. The loss-spike test runs on the agreed global loss, so every rank
computes the same z-score from the same history and reaches the same verdict without extra talk.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class FaultKind(IntEnum):
    """What went wrong in a step; the larger code (nearer the root cause) wins when several are seen."""

    OK = 0
    LOSS_SPIKE = 1
    NONFINITE_GRAD = 2
    NONFINITE_LOSS = 3   # a NaN loss also makes NaN gradients: name the loss, nearer the cause
    NONFINITE_INPUT = 4  # ... and a NaN input both
    EXCEPTION = 5

    @property
    def label(self) -> str:
        """How messages name the kind: "non-finite loss", "loss spike", "exception"."""
        return self.name.lower().replace("_", " ").replace("nonfinite", "non-finite")


class BadInputError(ValueError):
    """An input tensor that training must not consume (NaN or infinity in it)."""


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def nonfinite_inputs(inputs: Any) -> str | None:
    """A description of the first floating input with NaN/inf in ``inputs`` (nested), or None."""
    for i, t in enumerate(_tensors(inputs)):
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return (f"input tensor {i} (shape {tuple(t.shape)}, {str(t.dtype).replace('torch.', '')}) has "
                    f"{bad} non-finite value{'s' if bad != 1 else ''} (NaN or inf)")
    return None


def check_finite_inputs(*inputs: Any, where: str = "the step") -> None:
    """Raise ``BadInputError`` when any floating tensor in ``inputs`` holds NaN or inf.

    A guard for data pipelines: one clear error before the tensor reaches the model (where a NaN
    would surface much later as a NaN loss on another rank).
    """
    msg = nonfinite_inputs(inputs)
    if msg is not None:
        raise BadInputError(f"{where}: {msg}; only finite inputs are allowed")


def loss_stats(loss: Any) -> tuple[float, int, bool]:
    """(sum, count, all finite) of the loss values a rank computed (None: this rank has no loss)."""
    total, count, finite = 0.0, 0, True
    for t in _tensors(loss):
        v = t.detach().double()
        count += v.numel()
        s = float(v.sum())
        finite = finite and bool(torch.isfinite(v).all())
        total += s
    return total, count, finite


def grad_sq_norm(modules: Sequence[nn.Module], extra: Iterable[torch.Tensor] = ()) -> float:
    """Sum of squares of the local parameters' gradients (inf or nan when a gradient is not finite).

    One fused norm per device and a single host sync, so the check stays cheap on accelerators.
    A sharded (DTensor) gradient counts its local shard only: a check must never start a
    collective, since a rank whose step raised does not reach it. ``extra``: gradients that live
    outside ``.grad``, e.g. the reduced ZeRO-1 gradient shards (``GradSync.grad_shards``).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    for g in [*grads, *extra]:
        g = g.to_local() if isinstance(g, DTensor) else g
        if g.numel():
            by_device.setdefault(g.device, []).append(g.detach())
    total = 0.0
    for grads in by_device.values():
        norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
        total += float(torch.stack([n.double() for n in norms]).pow(2).sum())
    return total


class LossSpikeDetector:
    """Flags a loss whose z-score against the last ``window`` good losses exceeds ``zscore``.

    Only upward spikes count. The test needs ``min_history`` losses first (default
    ``max(2, min(window, 10))``: no spike is flagged in the first ten good steps) and a non-zero
    spread; the history is part of a snapshot, so a rewind also rewinds what counts as normal.
    """

    def __init__(self, zscore: float | None = 6.0, window: int = 50, min_history: int | None = None):
        if zscore is not None and not zscore > 0:
            raise ValueError(f"spike_zscore must be positive or None (off), got {zscore!r}")
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer of at least 2, got {window!r}")
        self.zscore = zscore
        self.window = window
        self.min_history = min_history if min_history is not None else max(2, min(window, 10))
        self.history: deque[float] = deque(maxlen=window)

    def score(self, loss: float) -> float | None:
        """The z-score of ``loss`` against the history, or None while the history is too short or flat."""
        if len(self.history) < self.min_history:
            return None
        n = len(self.history)
        mean = sum(self.history) / n
        var = sum((x - mean) ** 2 for x in self.history) / (n - 1)
        if var <= 0.0:
            return None
        return (loss - mean) / math.sqrt(var)

    def is_spike(self, loss: float) -> tuple[bool, float | None]:
        if self.zscore is None:
            return False, None
        z = self.score(loss)
        return (z is not None and z > self.zscore), z

    def push(self, loss: float) -> None:
        self.history.append(float(loss))

    def state(self) -> list[float]:
        return list(self.history)

    def load(self, values: Sequence[float]) -> None:
        self.history = deque((float(v) for v in values), maxlen=self.window)
