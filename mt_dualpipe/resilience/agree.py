"""Agreement: every rank learns every rank's verdict on a step, in bounded time.

Each rank contributes ``(fault code, loss sum, loss count, grad sum of squares)`` to one small
``all_gather`` on a dedicated gloo group (created with its own timeout, so it stays usable when the
pipeline's own group has broken, and never waits forever). The decision is a pure function of the
gathered table, hence identical on every rank: one rank's fault rewinds every rank. When a fault is
reported the ranks also exchange their messages (one ``all_gather_object``) so the log and the final
error can name the rank and the cause. If the collective itself fails (a rank died or hangs), the
caller gets ``AgreementError`` naming the step instead of a hang.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .detect import FaultKind


class AgreementError(RuntimeError):
    """The ranks could not exchange their verdicts (the group is broken or a rank is gone)."""


@dataclass
class LocalReport:
    """What one rank saw in one step."""

    kind: FaultKind = FaultKind.OK
    message: str = ""
    loss_sum: float = 0.0
    loss_count: int = 0
    grad_sq: float = 0.0

    def fault(self, kind: FaultKind, message: str) -> None:
        """Record a fault; the more severe kind (larger code) is kept."""
        if kind > self.kind:
            self.kind, self.message = kind, message


@dataclass
class Verdict:
    """The agreed outcome of a step (identical on every rank)."""

    kind: FaultKind
    loss: float | None  # mean over every loss value any rank computed
    grad_norm: float
    faulty_ranks: list[int] = field(default_factory=list)
    messages: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.kind == FaultKind.OK

    def describe(self) -> str:
        if self.ok:
            return "ok"
        parts = [f"rank {r}: {self.messages.get(r, '') or 'fault'}" for r in self.faulty_ranks]
        parts += [m for r, m in self.messages.items() if r < 0]  # findings of the agreed values (loss spike)
        return f"{self.kind.label} ({'; '.join(parts)})"


def _combine(rows: list[list[float]], messages: dict[int, str]) -> Verdict:
    kinds = [FaultKind(int(r[0])) for r in rows]
    worst = max(kinds)
    count = sum(r[2] for r in rows)
    loss = sum(r[1] for r in rows) / count if count else None
    grad_sq = sum(r[3] for r in rows)
    grad_norm = math.sqrt(grad_sq) if math.isfinite(grad_sq) else float("nan")
    faulty = [i for i, k in enumerate(kinds) if k != FaultKind.OK]
    return Verdict(worst, loss, grad_norm, faulty, messages)


class Agreement:
    """Combines the ranks' ``LocalReport``s over ``group`` (None: single process, nothing to agree)."""

    def __init__(self, ranks: list[int] | None, timeout: float):
        self.timeout = float(timeout)
        self.group = None
        self.rank = 0
        if ranks is not None and dist.is_available() and dist.is_initialized():
            # a collective over the default group: every rank must construct it, in the same order
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
            self.rank = dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def decide(self, step: int, report: LocalReport) -> Verdict:
        """Exchange the reports and return the verdict (blocking)."""
        return self.finish(self.start(step, report))

    def start(self, step: int, report: LocalReport) -> tuple:
        """Post the exchange of the reports and return at once; ``finish`` waits for it.

        What the caller does in between (``Rewind`` runs the optimizer step of a step it saw as good
        here) overlaps the wait for the slowest rank.
        """
        row = [float(report.kind), report.loss_sum, float(report.loss_count), report.grad_sq]
        if self.group is None:
            return step, report, row, None, None
        mine = torch.tensor(row, dtype=torch.float64)
        gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(self.world)]
        try:
            work = dist.all_gather(gathered, mine, group=self.group, async_op=True)
        except Exception as exc:  # the transport error types differ by backend
            raise self._error(step, report, exc) from exc
        return step, report, row, work, gathered

    def finish(self, pending: tuple) -> Verdict:
        """The verdict of an exchange posted by ``start`` (identical on every rank)."""
        step, report, row, work, gathered = pending
        if work is None:
            return _combine([row], {0: report.message} if report.kind else {})
        try:
            work.wait()
            rows = [g.tolist() for g in gathered]
            messages: dict[int, str] = {}
            if any(r[0] for r in rows):
                objs: list = [None] * self.world
                dist.all_gather_object(objs, report.message, group=self.group)
                messages = {i: m for i, m in enumerate(objs) if rows[i][0]}
        except Exception as exc:  # the transport error types differ by backend
            raise self._error(step, report, exc) from exc
        return _combine(rows, messages)

    def _error(self, step: int, report: LocalReport, exc: BaseException) -> AgreementError:
        return AgreementError(
            f"step {step}: the ranks could not agree on the step's outcome (a rank died, hangs for more "
            f"than {self.timeout:g}s, or the group is broken); this rank saw: "
            f"{report.kind.label}{': ' + report.message if report.message else ''}; "
            f"transport error: {str(exc).splitlines()[0][:200]}")
