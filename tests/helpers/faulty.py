"""A stage that raises in its F, B or W of a chosen micro-batch, and a batch that raises when the step
splits it: what the fail-fast tests and benchmark break.

``Faulty(dim)`` is one linear layer. ``arm(op, n)`` makes the n-th call (0-based, counted from
``arm``) of ``op`` raise ``InjectedError``: "F" in its forward, "B" when autograd reaches its
output's gradient (the input-gradient half of a split backward, or the whole BW), "W" when its
weight's gradient is accumulated (a split schedule's W, else the BW). ``raised_at`` is the
``time.time()`` of the raise, so a test can measure how long the other ranks took to stop.
``x.as_subclass(Unsplittable)`` is a batch whose split into micro-batches raises ``ValueError``, an
error no check of the step foresees.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

OPS = ("F", "B", "W")


class InjectedError(RuntimeError):
    """The error ``Faulty`` raises."""


class Unsplittable(torch.Tensor):
    """A batch whose split into micro-batches (``torch.tensor_split``) raises ``ValueError``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.tensor_split:
            raise ValueError("this batch refuses to be split")
        return super().__torch_function__(func, types, args, kwargs or {})


class _Probe(torch.autograd.Function):
    """Identity whose backward tells its stage that B reached it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stage: Faulty) -> torch.Tensor:
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.stage.tick("B")
        return grad, None


class Faulty(nn.Module):
    """A linear stage that raises ``InjectedError`` once armed (see the module docstring)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.plan: tuple[str, int] | None = None
        self.calls = dict.fromkeys(OPS, 0)
        self.raised_at: float | None = None
        self.lin.weight.register_post_accumulate_grad_hook(lambda p: self.tick("W"))

    def arm(self, op: str, n: int = 0) -> None:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        self.plan, self.raised_at = (op, n), None
        self.calls = dict.fromkeys(OPS, 0)

    def disarm(self) -> None:
        self.plan = None

    def tick(self, op: str) -> None:
        n = self.calls[op]
        self.calls[op] = n + 1
        if self.plan == (op, n):
            self.plan = None
            self.raised_at = time.time()
            raise InjectedError(f"injected {op} failure")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tick("F")
        return _Probe.apply(torch.tanh(self.lin(x)), self)
