"""The mt-dualpipe.schedule/1 JSON format and the torch.distributed.pipelining CSV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mt_dualpipe.schedules import (
    FB,
    Schedule,
    ScheduleError,
    build_schedule,
)
from tests.helpers.schedules import all_buildable

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- interchange ----------------
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_json_round_trip(P: int, M: int) -> None:
    for s in all_buildable(P, M):
        text = s.to_json()
        back = Schedule.from_json(text)
        assert back.to_json() == text
        assert back.ranks == s.ranks and back.placement == s.placement
        d = json.loads(text)
        assert d["format"] == "mt-dualpipe.schedule/1"
        assert set(d) == {"format", "name", "num_ranks", "num_microbatches", "placement", "microbatch_chain", "ranks"}


@pytest.mark.parametrize("text,message", [
    ("{", "schedule is not valid JSON"),
    ('{"format": "x"}', 'must have "format": "mt-dualpipe.schedule/1"'),
    ('{"format": "mt-dualpipe.schedule/1", "name": "a"}', "lacks the field"),
    ('{"format": "mt-dualpipe.schedule/1", "name": "a", "num_ranks": 1, "num_microbatches": 1, "placement": [[0]],'
     ' "microbatch_chain": [0], "ranks": [[{"op": "X", "chain": 0, "stage": 0, "mb": 0}]]}', "op must be one of"),
])
def test_json_errors(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_json(text)


def test_pipelining_csv() -> None:
    csv = build_schedule("dualpipev", 2, 4).to_pipelining_csv()
    rows = csv.strip().split("\n")
    assert len(rows) == 2
    assert rows[0].split(",")[:4] == ["0F0", "0F1", "0F2", "3F0"]
    assert sum(len(r.split(",")) for r in rows) == 4 * 4 * 3 - sum(
        1 for ops in build_schedule("dualpipev", 2, 4).ranks for i in ops
        for p in ((i.f, i.b) if type(i) is FB else (i,)) if p.kind == "BW")
    with pytest.raises(ScheduleError, match="only single-chain schedules"):
        build_schedule("dualpipe", 2, 4).to_pipelining_csv()
