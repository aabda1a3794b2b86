"""Fusing a B with its own W where splitting them buys nothing: a pass from program to program.

A zero-bubble schedule splits a backward into B (the input gradient) and W (the weight gradient) so the input
gradient can leave the rank while the rank computes something else. Where a rank's program runs W directly
after its own B, with no transfer posted between them (lowering posts a send right after the op that makes
it, ``lower.py``), that freedom is unused: the input gradient goes nowhere (the first stage) or to a later op
on the same rank, and the rank computes W next anyway. Running the two as one BW then changes no order of
ops or transfers and no gradient; it saves what the split costs at run time: a second engine call, the
frontier search, the tensors B keeps for W (``runtime/split.py``), and for a stage whose every backward
fuses, the split machinery altogether.

How often it applies: where the split has no transfer to make room for. On one rank holding every stage all
of them fuse (ZB-V at M = 8: 16 of 16 Ws); across ranks mostly the first stage's and the V's turn: ZB-V at
P = 4 and M = 8 fuses 12 of its 64 Ws, ZB-H1 8 of 32, DualPipe 4 of 10, DualPipeV 4 of 22. An F&B unit whose
backward half is followed by that backward's W fuses the same way (``FB(F, B)``, ``W`` -> ``FB(F, BW)``).

The runtime applies it to the program it executes (``runtime/modules.py``); schedules, their simulation and
their diagrams keep the B/W split the schedule was built with. ``Pipeline(..., fuse_backward=False)`` keeps
every split (what the split's own tests exercise). Memory is what changes: a fused backward frees what a split
B keeps for its W at once, so the planner walks ``executed_schedule`` (the order the runtime runs) when it
counts activation bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from .ir import FB, CommBatch, Instruction, Op, Program, Schedule
from .lower import lower
from .ops import BW, B, W


def _own_w(item: Instruction, nxt: Instruction) -> Op | None:
    """The BW that ``item`` followed by ``nxt`` amounts to, if ``item`` is (or ends in) a B and ``nxt`` its W."""
    if type(nxt) is not Op or nxt.kind != W:
        return None
    b = item.b if type(item) is FB else item
    if type(b) is not Op or b.kind != B or (b.chain, b.stage, b.mb) != (nxt.chain, nxt.stage, nxt.mb):
        return None
    return Op(BW, b.chain, b.stage, b.mb)


def fuse_adjacent_backward(program: Program) -> Program:
    """``program`` with every B directly followed by its own W (no ``CommBatch`` between) run as one BW."""
    ranks: list[list[Instruction]] = []
    changed = False
    for ops in program.ranks:
        out: list[Instruction] = []
        i = 0
        while i < len(ops):
            item = ops[i]
            fused = _own_w(item, ops[i + 1]) if i + 1 < len(ops) and type(item) is not CommBatch else None
            if fused is None:
                out.append(item)
                i += 1
                continue
            out.append(FB(item.f, fused) if type(item) is FB else fused)
            changed = True
            i += 2
        ranks.append(out)
    if not changed:
        return program
    return Program(Program(program.schedule, ranks).compute_schedule(), ranks)  # its schedule: the fused ops


_EXECUTED: OrderedDict[tuple[int, bool], tuple[Schedule, Schedule]] = OrderedDict()
EXECUTED_CACHE_SIZE = 64


def executed_schedule(schedule: Schedule, data_parallel: bool = False) -> Schedule:
    """The compute order the runtime executes for ``schedule`` (lowered, then ``fuse_adjacent_backward``):
    what the planner's activation-memory walk follows. Remembered for the last ``EXECUTED_CACHE_SIZE``
    schedule objects: the planner asks once per strategy, mostly for the same cached hand-built schedules,
    and lowering is most of what it would cost."""
    key = (id(schedule), data_parallel)
    hit = _EXECUTED.get(key)
    if hit is not None and hit[0] is schedule:
        _EXECUTED.move_to_end(key)
        return hit[1]
    executed = fuse_adjacent_backward(lower(schedule, data_parallel=data_parallel)).compute_schedule()
    _EXECUTED[key] = (schedule, executed)  # the schedule is kept alive with its entry, so its id is not reused
    if len(_EXECUTED) > EXECUTED_CACHE_SIZE:
        _EXECUTED.popitem(last=False)
    return executed
