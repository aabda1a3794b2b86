"""What every rank tells the others when a step starts, so a one-sided mistake fails everywhere at once.

A mistake made on one rank only (a different ``num_chunks``, labels forgotten on one of the ranks
that compute a loss, a batch that does not split, a rank under ``torch.no_grad()`` while the others
train) used to fail on that rank alone while its peers waited for messages until the
point-to-point timeout (300 s by default). The step already all-reduces a small fingerprint at its
start (``P2P.begin_step``); each rank adds one row of integers to it (``StepCheck.row``), so after
that all-reduce every rank sees every rank's row and ``verify`` raises the same error on all of
them, naming the rank that differs. A rank that found a problem before the step (its inputs do not
split, no criterion...) still takes part in the all-reduce and then raises its own, detailed error
(unless the ranks mixed lists with batched tensors, below: then the agreed error, the root cause).

Ragged steps (a list with one tensor per micro-batch in place of a batched tensor, ``modules.py``):
each rank also says how it passed its inputs and labels (a list of how many micro-batches, or
batched tensors) and a fingerprint of the rows each micro-batch holds, so every rank refuses a
step where one rank passes lists and another batched tensors, or where a chain's inputs and labels
split into different rows, before any micro-batch is sent.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .errors import PipelineError

NONE_GIVEN = -1  # inputs/labels: the rank holds the chain end but passed none
NOT_HELD = -2    # inputs/labels: the rank holds no first (last) stage, so it needs none
BATCHED = -3     # inputs/labels count: batched tensors, split along batch_dim (else: the length of the lists)

PROBLEMS = {
    1: "got no inputs although it holds the first stage of a chain",
    2: "its inputs do not split into num_chunks micro-batches",
    3: "its labels do not split into num_chunks micro-batches",
    4: "got no criterion although it holds the last stage of a chain (a training step needs one there)",
    5: "cannot run this step (bad num_chunks or schedule)",
    6: "passed its inputs as a list of {input_count} micro-batches, not one tensor per micro-batch of its chain",
    7: "passed its labels as a list of {label_count} micro-batches, not one tensor per micro-batch of its chain",
    8: "mixes lists of micro-batches with batched tensors in its inputs and labels",
    9: "passed inputs or labels that are neither Tensors, lists of Tensors (one per micro-batch) nor None",
    10: "raised an error while preparing the step",
}
"""Codes a rank reports when it cannot start the step; the rank itself raises the detailed error."""
UNEXPECTED = 10  # an error no check foresaw; the peers quote it from the link's board (link.py)


@dataclass(frozen=True)
class StepCheck:
    """This rank's row of the step-start agreement."""

    num_chunks: int
    training: int
    input_rows: int   # batch size of the inputs (lists: all micro-batches' rows), NONE_GIVEN or NOT_HELD
    label_rows: int   # batch size of the labels, likewise
    problem: int = 0  # a key of PROBLEMS, 0 when the rank can run the step
    input_count: int = NOT_HELD  # micro-batches in the inputs' lists, BATCHED, NONE_GIVEN or NOT_HELD
    label_count: int = NOT_HELD
    input_split: int = 0  # a fingerprint of the rows of each listed micro-batch (0 when batched)
    label_split: int = 0

    def row(self) -> tuple[int, ...]:
        return (self.num_chunks, self.training, self.input_rows, self.label_rows, self.problem, self.input_count,
                self.label_count, self.input_split, self.label_split)


@dataclass(frozen=True)
class Given:
    """How a rank passed its inputs (or labels), as the agreement sees it: never raises."""

    rows: int         # the batch size along batch_dim (a list: the rows of all its micro-batches), or a code
    count: int        # the length of the lists, BATCHED, NONE_GIVEN or NOT_HELD
    split: int = 0    # fingerprint of the rows per listed micro-batch


def given(values: Sequence[object], dim: int, held: bool) -> Given:
    """What ``values`` (a step's inputs or labels) tell the other ranks (``NOT_HELD`` where not needed).

    The first list (or tuple) of ``values`` makes the step ragged: its length and the rows of each of
    its tensors along ``dim``; otherwise the batch size of the first tensor.
    """
    if not held:
        return Given(NOT_HELD, NOT_HELD)
    listed = next((v for v in values if isinstance(v, (list, tuple))), None)
    if listed is not None:
        per_mb = [_rows(t, dim) or 0 for t in listed]
        return Given(sum(per_mb), len(per_mb), zlib.crc32(repr(per_mb).encode()) & 0x7FFFFFFF)
    rows = next((r for r in (_rows(v, dim) for v in values) if r is not None), None)
    return Given(NONE_GIVEN, NONE_GIVEN) if rows is None else Given(rows, BATCHED)


def _rows(value: object, dim: int) -> int | None:
    """The size of ``value`` along ``dim`` (None: not a tensor with that dimension)."""
    shape = getattr(value, "shape", None)
    return int(shape[dim]) if shape is not None and len(shape) > dim else None


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
    mixed = mixed_forms(rows)  # first: lists beside batched tensors explain any split problem they cause
    if mixed:
        raise PipelineError(mixed)
    for r, c in enumerate(checks):
        if c.problem and r != rank:
            what = PROBLEMS.get(c.problem, "cannot start the step").format(**asdict(c))
            raise PipelineError(f"rank {rank}: rank {r} {what} (its own error says more); every rank stops this step")
    if checks[rank].problem:
        return
    _differ(checks, "num_chunks", "num_chunks", "pass the same num_chunks to step() on every rank")
    _differ(checks, "training", "the kind of step (1: training, 0: inference under torch.no_grad())",
            "every rank must run the same kind of step")
    _check_labels(checks)
    for chain, (first, last) in enumerate(chain_ends):
        _check_chain(chain, first, last, checks[first], checks[last])


def mixed_forms(rows: Sequence[Sequence[int]] | None) -> str | None:
    """The error for a step with lists of micro-batches on some ranks (or for the inputs) and batched
    tensors on others (or for the labels), or None. Also what a rank that found a problem of its own
    raises instead of it (``labels=ys`` for ``labels=(ys,)`` makes four label values that do not split)."""
    checks = [StepCheck(*r) for r in rows or ()]
    forms = [(r, what, count) for r, c in enumerate(checks)
             for what, count in (("inputs", c.input_count), ("labels", c.label_count))
             if count == BATCHED or count >= 0]
    if len({count == BATCHED for _, _, count in forms}) < 2:
        return None
    listed = ", ".join(f"rank {r}'s {what}: " + ("batched tensors" if n == BATCHED else f"a list of {n}")
                       for r, what, n in forms)
    return (f"the step mixes lists of micro-batches with batched tensors ({listed}); pass every rank's inputs and "
            "labels the same way: lists with one tensor per micro-batch (each list one value: step([x0, x1, ...], "
            "labels=([y0, y1, ...],))) or batched tensors that the step splits along batch_dim")


def _check_chain(chain: int, first: int, last: int, inputs: StepCheck, labels: StepCheck) -> None:
    """A chain's inputs (on its first rank) and labels (on its last) must hold the same rows per micro-batch."""
    x, y = inputs.input_rows, labels.label_rows
    if inputs.input_count >= 0 and labels.label_count >= 0:
        if inputs.input_split != labels.label_split:
            raise PipelineError(f"chain {chain}: the micro-batches of the inputs on rank {first} and of the labels "
                                f"on rank {last} hold different rows along batch_dim ({x} and {y} in all); "
                                "micro-batch m's inputs and labels must have the same number of rows")
    elif x >= 0 and y >= 0 and x != y:
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
        self.seen: list[list[int]] | None = None  # the rows of the last agreement, accepted or not

    def __call__(self, rows: list[list[int]]) -> None:
        self.seen = rows
        if rows == self.accepted:
            return
        verify(rows, self.rank, self.chain_ends)
        if not StepCheck(*rows[self.rank]).problem:  # this rank had no problem of its own
            self.accepted = rows

    @property
    def ragged(self) -> bool:
        """Whether the last accepted step passed lists of micro-batches (on any rank: a last rank
        that got no labels learns it here)."""
        checks = [StepCheck(*r) for r in self.accepted or ()]
        return any(c.input_count >= 0 or c.label_count >= 0 for c in checks)
