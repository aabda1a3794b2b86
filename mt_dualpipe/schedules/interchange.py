"""JSON interchange (``mt-dualpipe.schedule/1``) and torch.distributed.pipelining's CSV actions.

The JSON layout is fixed, other tools read it::

    {"format": "mt-dualpipe.schedule/1", "name": str, "num_ranks": P, "num_microbatches": M,
     "placement": [[rank of stage s, for s in chain] for each chain],
     "microbatch_chain": [chain of micro-batch m, for m in 0..M-1],
     "ranks": [[op, ...] for each rank]}
    op: {"op": "F"|"B"|"W"|"BW", "chain": c, "stage": s, "mb": m} or {"op": "FB", "f": <F>, "b": <B|BW>}
"""

from __future__ import annotations

import json

from . import ops as K
from .errors import ScheduleError
from .ir import FB, SCHEDULE_FORMAT, ComputeItem, Op, Schedule
from .ops import BACKWARD_KINDS, COMPUTE_KINDS, STAGE_KINDS, OpKind


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
                    data["placement"], data["microbatch_chain"], ranks)


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
