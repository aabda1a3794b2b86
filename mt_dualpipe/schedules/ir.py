"""The schedule IR: compute ops, communication ops, ``Schedule`` and ``Program``, and their saved form.

A ``Schedule`` is pure data: for every rank, the ordered list of compute ops (F, B, W, BW and FB
pairs). ``lower()`` turns it into a ``Program`` by inserting batches of point-to-point
communication. Ops are small named tuples: cheap to build by the hundred thousand, hashable (so
they key dictionaries in the simulator and validator) and printable.

The saved form lives with the types it saves (so nothing imports the IR back): the JSON
interchange ``mt-dualpipe.schedule/1``, a fixed layout other tools read::

    {"format": "mt-dualpipe.schedule/1", "name": str, "num_ranks": P, "num_microbatches": M,
     "placement": [[rank of stage s, for s in chain] for each chain],
     "microbatch_chain": [chain of micro-batch m, for m in 0..M-1],
     "ranks": [[op, ...] for each rank],
     "microbatch_order": [the step's micro-batch that slot m runs, for m in 0..M-1]}   (optional)
    op: {"op": "F"|"B"|"W"|"BW"|"REDUCE_GRAD", "chain": c, "stage": s, "mb": m} or {"op": "FB", "f": <F>, "b": <B|BW>}

and torch.distributed.pipelining's compute-only CSV actions (``schedule_to_pipelining_csv``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar, Union

from . import ops as K
from .errors import ScheduleError
from .ops import BACKWARD_KINDS, COMPUTE_KINDS, STAGE_KINDS, OpKind, parts

SCHEDULE_FORMAT = "mt-dualpipe.schedule/1"


class Op(NamedTuple):
    """One compute op of one stage on one micro-batch: ``kind`` is F, B, W or BW."""

    kind: str
    chain: int
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(c{self.chain},s{self.stage},m{self.mb})"


class FB(NamedTuple):
    """An F and a B/BW of different micro-batches run as one overlapped unit (DualPipe's F&B)."""

    f: Op
    b: Op

    @property
    def kind(self) -> str:
        return K.FB

    def parts(self) -> tuple[Op, Op]:
        return (self.f, self.b)

    def __str__(self) -> str:
        return f"FB[{self.f} + {self.b}]"


class Comm(NamedTuple):
    """A point-to-point op. ``chain``/``stage``/``mb`` name the *local* stage on this rank.

    SEND_F(c, s, m) sends F(c, s, m)'s output to the rank of stage s+1, where RECV_F(c, s+1, m)
    receives it. SEND_B(c, s, m) sends B(c, s, m)'s input-gradient to the rank of stage s-1, where
    RECV_B(c, s-1, m) receives it.
    """

    kind: str
    peer: int
    chain: int
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(c{self.chain},s{self.stage},m{self.mb} peer={self.peer})"


class CommBatch(NamedTuple):
    """Communication ops posted together (one ``batch_isend_irecv`` call)."""

    ops: tuple[Comm, ...]

    @property
    def kind(self) -> str:
        return K.COMM

    def __str__(self) -> str:
        return "COMM[" + ", ".join(str(c) for c in self.ops) + "]"


ComputeItem = Union[Op, FB]
Instruction = Union[Op, FB, CommBatch]
T = TypeVar("T")


def check_microbatch_order(order: object, num_microbatches: int) -> tuple[int, ...]:
    """``order`` as a tuple of ints if it is a permutation of 0..M-1; else ``ScheduleError`` saying what is wrong."""
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise ScheduleError(f"microbatch_order must be a list of micro-batch indices, got {order!r}")
    if any(isinstance(m, bool) or not isinstance(m, int) for m in order):
        raise ScheduleError(f"microbatch_order must hold integers, got {list(order)!r}")
    if len(order) != num_microbatches:
        raise ScheduleError(f"microbatch_order has {len(order)} entries, expected one per micro-batch "
                            f"(num_microbatches={num_microbatches})")
    if sorted(order) != list(range(num_microbatches)):
        missing = sorted(set(range(num_microbatches)) - set(order))
        outside = sorted(set(order) - set(range(num_microbatches)))
        raise ScheduleError(f"microbatch_order must name each micro-batch 0..{num_microbatches - 1} once; "
                            f"missing {missing}" + (f", out of range {outside}" if outside else ""))
    return tuple(int(m) for m in order)


compute_parts = parts
"""The plain ops of a compute item: itself, or the two halves of an FB pair (``ops.parts``)."""


@dataclass
class Schedule:
    """Per-rank ordered compute ops plus the placement they run on.

    ``placement[c][s]`` is the rank that runs stage ``s`` of chain ``c``; ``microbatch_chain[m]``
    is the chain micro-batch ``m`` flows through. ``meta`` keeps the options the generator was
    built with (for example ``virtual_stages``), for display only.

    The ops name micro-batch *slots* 0..M-1. ``microbatch_order[m]`` is the micro-batch of the
    step (its index in the order the data arrives) that slot ``m`` runs: a permutation that a
    schedule built for uneven micro-batches chooses (``auto`` with ``Costs.mb_scale``), so that,
    say, a long sequence does not enter first or last. None means slot m runs micro-batch m. A
    runtime feeds slot m with ``to_slots(micro_batches)[m]`` and puts per-slot results back in
    arrival order with ``from_slots``; the simulator reads each slot's cost factor through it.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    placement: tuple[tuple[int, ...], ...]
    microbatch_chain: tuple[int, ...]
    ranks: list[list[ComputeItem]]
    meta: dict = field(default_factory=dict)
    microbatch_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.placement = tuple(tuple(int(r) for r in chain) for chain in self.placement)
        self.microbatch_chain = tuple(int(c) for c in self.microbatch_chain)
        if len(self.ranks) != self.num_ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has {len(self.ranks)} rank op lists, expected num_ranks={self.num_ranks}"
            )
        if len(self.microbatch_chain) != self.num_microbatches:
            raise ScheduleError(
                f"microbatch_chain has {len(self.microbatch_chain)} entries, "
                f"expected num_microbatches={self.num_microbatches}"
            )
        if self.microbatch_order is not None:
            self.microbatch_order = check_microbatch_order(self.microbatch_order, self.num_microbatches)

    # ----- placement queries -------------------------------------------------------------------
    @property
    def num_chains(self) -> int:
        return len(self.placement)

    def num_stages(self, chain: int = 0) -> int:
        """Number of stages of ``chain`` (all chains of the built-in schedules have the same)."""
        return len(self.placement[chain])

    def rank_of(self, chain: int, stage: int) -> int:
        return self.placement[chain][stage]

    def local_stages(self, rank: int) -> list[tuple[int, int]]:
        """The (chain, stage) pairs that ``rank`` runs, in (chain, stage) order.

        This is the order in which a rank passes its stage modules to ``Pipeline``.
        """
        return [(c, s) for c, chain in enumerate(self.placement)
                for s, r in enumerate(chain) if r == rank]

    def microbatches_of(self, chain: int) -> list[int]:
        return [m for m, c in enumerate(self.microbatch_chain) if c == chain]

    # ----- which micro-batch of the step each slot runs ------------------------------------------
    def arrival_of(self, slot: int) -> int:
        """The step's micro-batch (index in arrival order) that slot ``slot`` of the ops runs."""
        return slot if self.microbatch_order is None else self.microbatch_order[slot]

    def to_slots(self, micro_batches: Sequence[T]) -> list[T]:
        """``micro_batches`` (one per micro-batch, in arrival order) as the slots run them: item m is
        what slot m (the ops' ``mb == m``) takes."""
        if len(micro_batches) != self.num_microbatches:
            raise ScheduleError(f"got {len(micro_batches)} micro-batches, the schedule runs {self.num_microbatches}")
        return [micro_batches[self.arrival_of(m)] for m in range(self.num_microbatches)]

    def from_slots(self, per_slot: Sequence[T]) -> list[T]:
        """The inverse of ``to_slots``: per-slot results (outputs, losses) back in arrival order."""
        if len(per_slot) != self.num_microbatches:
            raise ScheduleError(f"got {len(per_slot)} per-slot results, the schedule runs {self.num_microbatches}")
        out: list = [None] * self.num_microbatches
        for m, item in enumerate(per_slot):
            out[self.arrival_of(m)] = item
        return out

    @property
    def splits_backward(self) -> bool:
        """True when any rank runs separate B and W ops."""
        return any(p.kind == K.W for ops in self.ranks for item in ops for p in compute_parts(item))

    def ops(self, rank: int) -> Sequence[ComputeItem]:
        return self.ranks[rank]

    def iter_ops(self) -> Iterator[tuple[int, int, ComputeItem]]:
        for r, ops in enumerate(self.ranks):
            for i, item in enumerate(ops):
                yield r, i, item

    def num_ops(self) -> int:
        return sum(len(ops) for ops in self.ranks)

    # ----- the saved form (the functions at the end of this module) ------------------------------
    def to_dict(self) -> dict:
        return schedule_to_dict(self)

    def to_json(self, indent: int | None = None) -> str:
        return schedule_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return schedule_from_json(text)

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        return schedule_from_dict(data)

    def to_pipelining_csv(self) -> str:
        return schedule_to_pipelining_csv(self)

    def __str__(self) -> str:
        lines = [f"{self.name}: P={self.num_ranks} M={self.num_microbatches} chains={self.num_chains}"]
        for r, ops in enumerate(self.ranks):
            lines.append(f"  rank {r}: " + " ".join(_short(item) for item in ops))
        return "\n".join(lines)


def _short(item: ComputeItem) -> str:
    if type(item) is FB:
        return f"[{_short(item.f)}+{_short(item.b)}]"
    return f"{item.kind}{item.mb}" + (f"@s{item.stage}" if item.stage else "")


@dataclass
class Program:
    """A lowered schedule: per rank, compute ops interleaved with ``CommBatch`` es."""

    schedule: Schedule
    ranks: list[list[Instruction]]

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def name(self) -> str:
        return self.schedule.name

    def compute_ops(self, rank: int) -> list[ComputeItem]:
        return [i for i in self.ranks[rank] if type(i) is not CommBatch]

    def compute_schedule(self) -> Schedule:
        """The program without its communication: what simulation and compute validation read."""
        s = self.schedule
        return Schedule(s.name, s.num_ranks, s.num_microbatches, s.placement, s.microbatch_chain,
                        [self.compute_ops(r) for r in range(s.num_ranks)], s.meta, s.microbatch_order)

    def num_comm_ops(self) -> int:
        return sum(len(i.ops) for ops in self.ranks for i in ops if type(i) is CommBatch)

    def __str__(self) -> str:
        lines = [f"program {self.name}: P={self.num_ranks}"]
        for r, ops in enumerate(self.ranks):
            lines.append(f"  rank {r}:")
            lines.extend(f"    {i:4d} {ins}" for i, ins in enumerate(ops))
        return "\n".join(lines)


# ----- the saved form: JSON interchange and torch.distributed.pipelining's CSV ------------------------
def _op_to_dict(op: Op) -> dict:
    return {"op": op.kind, "chain": op.chain, "stage": op.stage, "mb": op.mb}


def item_to_dict(item: ComputeItem) -> dict:
    if type(item) is FB:
        return {"op": "FB", "f": _op_to_dict(item.f), "b": _op_to_dict(item.b)}
    return _op_to_dict(item)


def schedule_to_dict(schedule: Schedule) -> dict:
    return {
        "format": SCHEDULE_FORMAT,
        "name": schedule.name,
        "num_ranks": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "placement": [list(c) for c in schedule.placement],
        "microbatch_chain": list(schedule.microbatch_chain),
        "ranks": [[item_to_dict(i) for i in ops] for ops in schedule.ranks],
        **({} if schedule.microbatch_order is None else {"microbatch_order": list(schedule.microbatch_order)}),
    }


def schedule_to_json(schedule: Schedule, indent: int | None = None) -> str:
    separators = (",", ":") if indent is None else None
    return json.dumps(schedule_to_dict(schedule), indent=indent, separators=separators)


def _op_from_dict(d: object, where: str) -> Op:
    if not isinstance(d, dict):
        raise ScheduleError(f"{where}: an op must be an object, got {d!r}")
    kind = d.get("op")
    if kind not in COMPUTE_KINDS and kind not in STAGE_KINDS:
        raise ScheduleError(f"{where}: op must be one of F, B, W, BW, FB, REDUCE_GRAD, got {kind!r}")
    try:
        return Op(OpKind(kind), int(d["chain"]), int(d["stage"]), int(d["mb"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ScheduleError(f"{where}: op {d!r} needs integer 'chain', 'stage' and 'mb'") from exc


def item_from_dict(d: object, where: str) -> ComputeItem:
    if isinstance(d, dict) and d.get("op") == K.FB:
        f, b = _op_from_dict(d.get("f"), where + ".f"), _op_from_dict(d.get("b"), where + ".b")
        if f.kind != K.F or b.kind not in BACKWARD_KINDS:
            raise ScheduleError(f"{where}: an FB pairs an F with a B or BW, got {f.kind} and {b.kind}")
        return FB(f, b)
    return _op_from_dict(d, where)


def schedule_from_dict(data: dict) -> Schedule:
    if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ScheduleError(f"schedule JSON must have \"format\": \"{SCHEDULE_FORMAT}\", got {got!r}")
    missing = [k for k in ("name", "num_ranks", "num_microbatches", "placement", "microbatch_chain", "ranks")
               if k not in data]
    if missing:
        raise ScheduleError(f"schedule JSON lacks the field(s) {', '.join(missing)}")
    ranks = [[item_from_dict(d, f"rank {r} op {i}") for i, d in enumerate(ops)] for r, ops in enumerate(data["ranks"])]
    return Schedule(str(data["name"]), int(data["num_ranks"]), int(data["num_microbatches"]),
                    data["placement"], data["microbatch_chain"], ranks,
                    microbatch_order=data.get("microbatch_order"))


def schedule_from_json(text: str) -> Schedule:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"schedule is not valid JSON: {exc}") from exc
    return schedule_from_dict(data)


_CSV_ACTION = {"F": "F", "B": "I", "W": "W", "BW": "B"}


def schedule_to_pipelining_csv(schedule: Schedule) -> str:
    """torch.distributed.pipelining's compute-only CSV: one row per rank, ``0F0,0I0,0W0,...``.

    Each action is ``<stage index><F|I|W|B><micro-batch>`` where the stage index is the global
    stage id (position in the single chain). FB units are written as their two halves.
    """
    if schedule.num_chains != 1:
        raise ScheduleError(
            f"only single-chain schedules export to torch.distributed.pipelining CSV; "
            f"{schedule.name!r} has {schedule.num_chains} chains"
        )
    rows = []
    for ops in schedule.ranks:
        actions = []
        for item in ops:
            for op in ((item.f, item.b) if type(item) is FB else (item,)):
                actions.append(f"{op.stage}{_CSV_ACTION[op.kind]}{op.mb}")
        rows.append(",".join(actions))
    return "\n".join(rows) + "\n"
