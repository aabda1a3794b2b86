"""docs/schedules.md against the code: its worked values and its DualPipe listing are re-derived here.

The doc's figures are data. Each row of its worked-values table is built and simulated, and the
rank orders it prints are compared with ``str(schedule)``, so a change to a generator, the cost
model or the simulator that moves a figure fails here until the doc says the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, add_grad_reduction, build_schedule, list_schedules, simulate

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedules.md"
COLUMNS = ["schedule", "P", "M", "options", "costs", "makespan", "bubble %", "peak", "bubble", "span"]
ORDER_MARK = "<!-- order: dualpipe P=4 M=8 -->"


def _between(lines: list[str], begin: str, end: str) -> list[str]:
    """The lines strictly between the marker lines ``begin`` and ``end``."""
    try:
        i = lines.index(begin)
        j = lines.index(end, i + 1)
    except ValueError as exc:
        raise AssertionError(f"{DOC} lacks the markers {begin!r} ... {end!r}") from exc
    return lines[i + 1:j]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def worked_rows() -> list[dict[str, str]]:
    """The worked-values table as one dict per row, keyed by its header."""
    lines = _between(DOC.read_text().splitlines(), "<!-- worked-values:begin -->", "<!-- worked-values:end -->")
    table = [ln for ln in lines if ln.startswith("|")]
    header = _cells(table[0])
    assert header == COLUMNS, f"worked-values header is {header}, expected {COLUMNS}"
    rows = []
    for ln in table[2:]:  # after the header and its |---| line
        cells = _cells(ln)
        assert len(cells) == len(COLUMNS), f"worked-values row has {len(cells)} cells: {ln}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def fields(cell: str) -> dict[str, str]:
    """``key=value key=value`` (``-`` for none) as a dict."""
    if cell == "-":
        return {}
    out = {}
    for part in cell.split():
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"malformed field {part!r} in {cell!r}; expected key=value")
        out[key] = value
    return out


def costs_of(cell: str) -> Costs:
    """A costs cell: ``Costs`` fields, a per-stage list written with ``/``."""
    kw: dict[str, object] = {}
    for key, value in fields(cell).items():
        kw[key] = [float(x) for x in value.split("/")] if "/" in value else float(value)
    return Costs(**kw)


def options_of(cell: str) -> dict[str, object]:
    return {k: int(v) if v.isdigit() else v for k, v in fields(cell).items()}


ROWS = worked_rows()


def _row_id(row: dict[str, str]) -> str:
    extra = "".join(f"-{x}" for x in (row["options"], row["costs"]) if x != "-")
    return f"{row['schedule']}-P{row['P']}-M{row['M']}{extra}".replace(" ", ",")


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_worked_value(row: dict[str, str]) -> None:
    costs = costs_of(row["costs"])
    options = options_of(row["options"])
    when = options.pop("grad_reduction", None)
    if row["schedule"] == "auto":
        options["costs"] = costs
    schedule = build_schedule(row["schedule"], int(row["P"]), int(row["M"]), **options)
    if when is not None:
        schedule = add_grad_reduction(schedule, str(when))
    res = simulate(schedule, costs)
    got = {
        "makespan": f"{res.makespan:g}",
        "bubble %": f"{100 * res.bubble_rate:.2f}",
        "peak": str(max(res.peak_activations)),
        "bubble": f"{max(res.makespan_bubble):g}",
        "span": f"{max(res.span_bubble):g}",
    }
    assert got == {k: row[k] for k in got}


def test_table_covers_every_registered_schedule() -> None:
    assert {r["schedule"] for r in ROWS} == {info.name for info in list_schedules()}


def test_dualpipe_listing_is_what_the_generator_prints() -> None:
    lines = DOC.read_text().splitlines()
    start = lines.index(ORDER_MARK)
    block = _between(lines[start + 1:], "```text", "```")
    expected = [ln.strip() for ln in str(build_schedule("dualpipe", 4, 8)).splitlines()[1:]]
    assert block == expected


def test_cells_parse_as_documented() -> None:
    assert costs_of("-") == Costs()
    assert costs_of("f=0.5 a2a_b=1") == Costs(f=0.5, a2a_b=1.0)
    assert costs_of("f=1/2") == Costs(f=[1.0, 2.0])
    assert options_of("virtual_stages=2 placement=v") == {"virtual_stages": 2, "placement": "v"}
    with pytest.raises(ValueError, match="malformed field 'f' in 'f'; expected key=value"):
        fields("f")
    with pytest.raises(ScheduleError, match="costs.f has 2 per-stage values but the chain has 4 stages"):
        simulate(build_schedule("1f1b", 4, 4), costs_of("f=1/2"))
