"""validate(): exactly-once ops, placement, FB shape, deadlock detection with named cycles."""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_dualpipe.schedules import (
    FB,
    Op,
    Schedule,
    ScheduleError,
    validate,
)

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- validate -------------------
def tiny(ranks: list[list]) -> Schedule:
    return Schedule("hand", 2, 1, ((0, 1),), (0,), ranks)


def test_validate_accepts_minimal() -> None:
    validate(tiny([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("W", 0, 1, 0)]]))


@pytest.mark.parametrize("ranks,message", [
    ([[Op("F", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]], r"rank 0: \(c0,s0,m0\) lacks a BW, or a B and a W"),
    ([[Op("F", 0, 0, 0), Op("B", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]], r"\(c0,s0,m0\) lacks W"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0), Op("F", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"rank 0 op 2 F\(c0,s0,m0\): duplicate, already at rank 0 op 0"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0), Op("F", 0, 1, 0)], [Op("BW", 0, 1, 0)]],
     r"rank 0 op 2 F\(c0,s1,m0\): the placement puts chain 0 stage 1 on rank 1"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("F", 0, 1, 3), Op("BW", 0, 1, 0)]], r"micro-batch 3 out of range"),
    ([[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("BW", 0, 1, 0), Op("F", 0, 1, 0)]],
     r"deadlock: rank 1 op 0 BW\(c0,s1,m0\) waits for F\(c0,s1,m0\), which rank 1 runs later or never"),
    ([[Op("F", 0, 0, 0), Op("W", 0, 0, 0), Op("B", 0, 0, 0)], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"rank 0 op 1 W\(c0,s0,m0\) waits for B\(c0,s0,m0\), which rank 0 runs later"),
    ([[FB(Op("F", 0, 0, 0), Op("BW", 0, 0, 0))], [Op("F", 0, 1, 0), Op("BW", 0, 1, 0)]],
     r"an FB pairs two different micro-batches"),
])
def test_validate_errors(ranks: list, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(tiny(ranks))


def test_deadlock_cycle_is_named() -> None:
    # each rank first runs a forward whose input the other rank only produces in its second op
    s = Schedule("hand", 2, 2, ((0, 1), (1, 0)), (0, 1), [
        [Op("F", 1, 1, 1), Op("F", 0, 0, 0), Op("BW", 1, 1, 1), Op("BW", 0, 0, 0)],
        [Op("F", 0, 1, 0), Op("F", 1, 0, 1), Op("BW", 0, 1, 0), Op("BW", 1, 0, 1)],
    ])
    with pytest.raises(ScheduleError, match=r"deadlock: ranks wait in a cycle (0 -> 1 -> 0|1 -> 0 -> 1)") as exc:
        validate(s)
    assert "rank 0 op 0 F(c1,s1,m1) waits for F(c1,s0,m1) on rank 1" in str(exc.value)
    assert "rank 1 op 0 F(c0,s1,m0) waits for F(c0,s0,m0) on rank 0" in str(exc.value)
