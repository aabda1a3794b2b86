"""Fault injection for tests and demos: NaN on a chosen rank and step, an exception in a chosen
op, killing a rank (during a step or while a checkpoint is being committed).

Usage::

    faults = FaultInjector(rank=dist.get_rank())
    faults.nan(rank=1, step=5)                      # NaN in the output of local module 0 at step 5
    faults.raise_in(rank=0, step=7, op="backward")  # InjectedFault inside module 0's backward
    faults.kill(rank=1, step=9)                     # os._exit(KILL_EXIT_CODE) in module 0's forward
    faults.kill(rank=0, step=10, when="commit")     # die before the checkpoint of step 10 is committed
    rw = Rewind(pipeline, optimizer, ..., faults=faults)

Steps are 0-based optimizer steps (``Rewind.step_index`` when the step starts). Each planned fault
fires once, and at most one fires per step attempt (the first micro-batch that reaches it): the
replay after a rewind runs clean unless the plan holds another fault for that step. ``Rewind`` tells the
injector which step is running (``begin_step``) and installs its module hooks (``attach``); a fault
planned for another rank is ignored on this one, so every rank can hold the same plan.

``module`` is an index into the rank's *local* modules as ``Rewind`` sees them (``modules=``, or the
pipeline's stage modules ``pipeline.module`` in ``local_stages`` order): on a V or DualPipe
placement module 0 is the rank's stage of the first chain / the down leg and module 1 its other
stage, not a layer of the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

KILL_EXIT_CODE = 43
OPS = ("forward", "backward")
KINDS = ("nan", "raise", "kill")


class InjectedFault(RuntimeError):
    """The exception ``raise_in`` throws."""


@dataclass
class PlannedFault:
    kind: str       # "nan" | "raise" | "kill"
    rank: int
    step: int
    op: str = "forward"   # "forward" | "backward" | "commit" (kill only)
    module: int = 0       # index into the rank's local modules
    fired: bool = False


class FaultInjector:
    """A plan of faults; see the module docstring."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.plan: list[PlannedFault] = []
        self.step: int | None = None
        self._handles: list = []
        self._fired_now = False

    # ----- planning -----------------------------------------------------------------------------
    def _add(self, kind: str, rank: int, step: int, op: str, module: int) -> PlannedFault:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        allowed = OPS + (("commit",) if kind == "kill" else ())
        if op not in allowed:
            raise ValueError(f"op for a {kind} fault must be one of {', '.join(allowed)}, got {op!r}")
        fault = PlannedFault(kind, rank, step, op, module)
        self.plan.append(fault)
        return fault

    def nan(self, rank: int, step: int, module: int = 0, op: str = "forward") -> PlannedFault:
        """Fill the output of local module ``module`` (forward) or its input gradient (backward) with NaN."""
        return self._add("nan", rank, step, op, module)

    def raise_in(self, rank: int, step: int, op: str = "forward", module: int = 0) -> PlannedFault:
        """Raise ``InjectedFault`` inside the forward or backward of local module ``module``."""
        return self._add("raise", rank, step, op, module)

    def kill(self, rank: int, step: int, when: str = "forward", module: int = 0) -> PlannedFault:
        """End the process with ``os._exit(KILL_EXIT_CODE)``: in a module's forward/backward, or at
        ``when="commit"`` after the checkpoint of ``step`` is written but before it is committed."""
        return self._add("kill", rank, step, when, module)

    # ----- wiring -------------------------------------------------------------------------------
    def attach(self, modules: Sequence[nn.Module]) -> None:
        """Install forward / backward hooks on the local modules the plan names."""
        self.detach()
        for idx in sorted({f.module for f in self.plan if f.rank == self.rank and f.op in OPS}):
            if idx >= len(modules):
                raise ValueError(f"a fault targets local module {idx} but rank {self.rank} has {len(modules)}")
            m = modules[idx]
            self._handles.append(m.register_forward_hook(self._forward_hook(idx)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def begin_step(self, step: int) -> None:
        self.step = step
        self._fired_now = False

    def _due(self, op: str, module: int | None = None) -> list[PlannedFault]:
        if self._fired_now:  # one fault per step attempt: a second one planned there waits for the replay
            return []
        return [f for f in self.plan if not f.fired and f.rank == self.rank and f.step == self.step and f.op == op
                and (module is None or f.module == module)]

    def _fire(self, fault: PlannedFault) -> None:
        fault.fired = self._fired_now = True
        where = f"rank {self.rank}, step {fault.step}, {fault.op} of local module {fault.module}"
        if fault.kind == "kill":
            os._exit(KILL_EXIT_CODE)
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault ({where})")

    def _forward_hook(self, idx: int):
        def hook(module: nn.Module, args: tuple, output: object) -> object:
            for fault in self._due("forward", idx)[:1]:
                if fault.kind == "nan":
                    fault.fired = self._fired_now = True
                    output = _poison(output)
                else:
                    self._fire(fault)
            due_b = self._due("backward", idx)[:1]
            if due_b:
                self._fired_now = True
                first = _first_tensor(output)
                if first is None or not first.requires_grad:
                    raise ValueError(f"a backward fault targets local module {idx} but its output has no grad")
                first.register_hook(self._backward_hook(due_b))
            return output
        return hook

    def _backward_hook(self, faults: list[PlannedFault]):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            for fault in faults:
                if fault.fired:
                    continue
                if fault.kind == "nan":
                    fault.fired = True
                    grad = torch.full_like(grad, float("nan"))
                else:
                    self._fire(fault)
            return grad
        return hook

    def before_commit(self, step: int) -> None:
        """Called by the checkpoint writer right before it commits ``step`` (rank 0)."""
        for fault in self.plan:
            if not fault.fired and fault.kind == "kill" and fault.op == "commit" and fault.step == step \
                    and fault.rank == self.rank:
                self._fire(fault)


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _poison(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value * float("nan") if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_poison(v) for v in value)
    return value
