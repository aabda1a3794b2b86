"""What every rank tells the others when a step starts, so a one-sided mistake fails everywhere at once.

A mistake made on one rank only (a different ``num_chunks``, labels forgotten on one of the ranks
that compute a loss, a batch that does not split, a rank under ``torch.no_grad()`` while the others
train) used to fail on that rank alone while its peers waited for messages until the
point-to-point timeout (300 s by default). The step already all-reduces a small fingerprint at its
start (``P2P.begin_step``); each rank adds one row of integers to it (``StepCheck.row``), so after
that all-reduce every rank sees every rank's row and ``verify`` raises the same error on all of
them, naming the rank that differs. A rank that found a problem before the step (its inputs do not
split, no criterion...) still takes part in the all-reduce and then raises its own, detailed error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PipelineError

NONE_GIVEN = -1  # inputs/labels: the rank holds the chain end but passed none
NOT_HELD = -2    # inputs/labels: the rank holds no first (last) stage, so it needs none

PROBLEMS = {
    1: "got no inputs although it holds the first stage of a chain",
    2: "its inputs do not split into num_chunks micro-batches",
    3: "its labels do not split into num_chunks micro-batches",
    4: "got no criterion although it holds the last stage of a chain (a training step needs one there)",
    5: "cannot run this step (bad num_chunks or schedule)",
}
"""Codes a rank reports when it cannot start the step; the rank itself raises the detailed error."""


@dataclass(frozen=True)
class StepCheck:
    """This rank's row of the step-start agreement."""

    num_chunks: int
    training: int
    input_rows: int   # batch size of the inputs, NONE_GIVEN or NOT_HELD
    label_rows: int   # batch size of the labels, NONE_GIVEN or NOT_HELD
    problem: int = 0  # a key of PROBLEMS, 0 when the rank can run the step

    def row(self) -> tuple[int, ...]:
        return (self.num_chunks, self.training, self.input_rows, self.label_rows, self.problem)


def batch_rows(values: Sequence[object], dim: int, held: bool) -> int:
    """The batch size of the first tensor in ``values`` along ``dim`` (NONE_GIVEN / NOT_HELD otherwise)."""
    if not held:
        return NOT_HELD
    for v in values:
        shape = getattr(v, "shape", None)
        if shape is not None and len(shape) > dim:
            return int(shape[dim])
    return NONE_GIVEN


def _differ(rows: list[StepCheck], field: str, what: str, hint: str) -> None:
    values = [getattr(r, field) for r in rows]
    if len(set(values)) > 1:
        listed = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise PipelineError(f"the ranks disagree on {what} ({listed}); {hint}")


def verify(rows: Sequence[Sequence[int]], rank: int, chain_ends: Sequence[tuple[int, int]]) -> None:
    """Raise the same ``PipelineError`` on every rank when the rows of the ranks disagree.

    ``rows[r]``: rank r's ``StepCheck.row()``; ``chain_ends``: per chain, (first rank, last rank).
    The rank that found a problem itself is left to raise its own error.
    """
    checks = [StepCheck(*r) for r in rows]
    for r, c in enumerate(checks):
        if c.problem and r != rank:
            raise PipelineError(f"rank {rank}: rank {r} {PROBLEMS.get(c.problem, 'cannot start the step')} "
                                "(its own error says more); every rank stops this step")
    if checks[rank].problem:
        return
    _differ(checks, "num_chunks", "num_chunks", "pass the same num_chunks to step() on every rank")
    _differ(checks, "training", "the kind of step (1: training, 0: inference under torch.no_grad())",
            "every rank must run the same kind of step")
    _check_labels(checks)
    for chain, (first, last) in enumerate(chain_ends):
        x, y = checks[first].input_rows, checks[last].label_rows
        if x >= 0 and y >= 0 and x != y:
            raise PipelineError(f"chain {chain}: the inputs on rank {first} have a batch of {x} but the labels on "
                                f"rank {last} have {y}; both are split into the same num_chunks micro-batches, so "
                                "pass the same batch size on every rank")


def _check_labels(checks: list[StepCheck]) -> None:
    """Among the ranks that compute a loss, labels given on some but not on others."""
    if not checks[0].training:
        return
    holders = [r for r, c in enumerate(checks) if c.label_rows != NOT_HELD]
    without = [r for r in holders if checks[r].label_rows == NONE_GIVEN]
    if without and len(without) < len(holders):
        given = [r for r in holders if r not in without]
        raise PipelineError(f"rank(s) {', '.join(map(str, without))} hold the last stage of a chain but passed no "
                            f"labels, while rank(s) {', '.join(map(str, given))} did; pass labels= to step() on "
                            "every rank that computes a loss")


class StepVerifier:
    """``verify`` for one pipeline rank, remembering the last rows it accepted.

    Steps of a training loop send the same rows every time; comparing them with the last accepted
    ones keeps the per-step cost of the checks to one list comparison.
    """

    def __init__(self, rank: int, chain_ends: Sequence[tuple[int, int]]):
        self.rank, self.chain_ends = rank, list(chain_ends)
        self.accepted: list[list[int]] | None = None

    def __call__(self, rows: list[list[int]]) -> None:
        if rows == self.accepted:
            return
        verify(rows, self.rank, self.chain_ends)
        if not rows[self.rank][-1]:  # this rank had no problem of its own
            self.accepted = rows
