"""``--dp-sync``: show/render/compare place and price each stage's data-parallel gradient reduction."""

from __future__ import annotations

import pytest

from mt_dualpipe.cli import main
from mt_dualpipe.cli.schedule_cmds import compare_results, exposed_sync
from mt_dualpipe.schedules import Costs, add_grad_reduction, build_schedule, simulate
from tests.helpers.diagrams import needs_dot, svg_boxes, svg_text


def table_row(out: str, label: str) -> list[str]:
    """The cells of the table row whose first cell is ``label``."""
    rows = ([cell.strip() for cell in line.strip("│").split("│")] for line in out.splitlines() if line.startswith("│"))
    return next(cells for cells in rows if cells[0].removesuffix(" ★") == label)


def test_show_dp_sync_lists_reductions_and_their_exposure(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", "zbv", "-p", "2", "-m", "4", "--dp-sync", "2", "--plain"]) == 0
    out = capsys.readouterr().out
    rank0 = out[out.index("rank 0"):out.index("rank 1")].split()
    # zbv rank 0 holds stages 0 and 3: each is reduced right after its own last W (stage 3's comes first)
    assert [t for t in rank0 if t.startswith("R/")] == ["R/s3", "R/s0"] and rank0[-1] == "R/s0"
    last_w3 = max(i for i, t in enumerate(rank0) if t.startswith("W") and t.endswith("/s3"))
    assert rank0[last_w3 + 1] == "R/s3" and rank0[-2].startswith("W") and rank0[-2].endswith("/s0")
    res = simulate(add_grad_reduction(build_schedule("zbv", 2, 4)), Costs(1, 1, 1, dp_sync=2))
    assert f"exposed DP sync {max(res.dp_exposed):g} (per rank: {res.dp_exposed[0]:g} {res.dp_exposed[1]:g})" in out
    assert f"zbv: makespan {res.makespan:g}, bubble rate {100 * res.bubble_rate:.2f} %, exposed DP sync" in out
    for r in range(2):
        assert table_row(out, str(r))[-1] == f"{res.dp_exposed[r]:g}"
    comm_rows = [line for line in out.splitlines() if line.startswith("   ╎")]
    assert len(comm_rows) == 2 and all(line.count("R/s") == 2 for line in comm_rows)


def test_show_sync_at_step_end_and_bad_value(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", "1f1b", "-p", "2", "-m", "2", "--dp-sync", "5", "--sync-at", "step_end"]) == 0
    out = capsys.readouterr().out
    assert "1f1b: makespan 14, bubble rate" in out  # the hand-checked 1f1b case: compute ends at 9, +5
    assert main(["show", "1f1b", "-p", "2", "-m", "2", "--dp-sync", "-1"]) == 2
    assert "--dp-sync must be a non-negative number, got -1" in capsys.readouterr().err


def test_show_without_dp_sync_has_no_reductions(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["show", "1f1b", "-p", "2", "-m", "2"]) == 0
    out = capsys.readouterr().out
    assert "R/s" not in out and "exposed DP sync" not in out and "╎" not in out


@needs_dot
def test_render_dp_sync_draws_a_reduce_box_per_stage_per_rank(tmp_path, capsys):
    out = tmp_path / "d.svg"
    assert main(["render", "dualpipe", "-p", "4", "-m", "8", "--dp-sync", "2", "-o", str(out)]) == 0
    boxes = svg_boxes(out, "reduce")
    assert sorted(boxes) == sorted(f"reduce_r{r}_{i}" for r in range(4) for i in range(2))


def test_render_dp_sync_terminal_and_refused_with_a_timeline(tmp_path, capsys):
    assert main(["render", "zb-h1", "-p", "4", "-m", "8", "--dp-sync", "1", "--plain", "--width", "160"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("   ╎") for line in out.splitlines()) == 4 and "exposed DP sync 1" in out
    assert main(["render", "--timeline", str(tmp_path / "x.json"), "--dp-sync", "1"]) == 2
    assert "--dp-sync prices a simulated schedule's gradient reductions" in capsys.readouterr().err


def test_compare_dp_sync_overlapped_versus_at_step_end(monkeypatch, capsys):
    P, M, sync = 4, 8, 2.0
    rows = {r.name: r for r in compare_results(P, M, Costs(1, 1, 1), dp_sync=sync) if r.result}
    for name, r in rows.items():
        scaled = Costs(1, 1, 1).scaled(r.fraction)
        priced = Costs(scaled.f, scaled.b, scaled.w, dp_sync=sync * r.fraction)
        want = simulate(add_grad_reduction(r.schedule), priced)
        at_end = simulate(add_grad_reduction(r.schedule, "step_end"), priced)
        assert (r.result.makespan, r.at_end.makespan) == (want.makespan, at_end.makespan), name
        assert r.result.makespan <= r.at_end.makespan, name
    # linear placements: stage 0's last W is rank 0's last op, so its reduction is never hidden
    for name in ("1f1b", "gpipe", "zb-h1", "zb-h2"):
        assert exposed_sync(rows[name].result) == pytest.approx(sync), name
    # V and dual placements hide part of it behind the drain; DualPipe holds two full stages per rank
    for name in ("zbv", "dualpipev"):
        assert exposed_sync(rows[name].result) < sync * rows[name].fraction * 2, name
        assert rows[name].result.makespan < rows[name].at_end.makespan, name
    assert rows["dualpipe"].result.makespan < rows["dualpipe"].at_end.makespan
    assert exposed_sync(rows["dualpipe"].result) < 2 * sync
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["compare", "-p", str(P), "-m", str(M), "--dp-sync", "2"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "schedule" in line and "makespan" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][:4] == ["schedule", "makespan", "sync at end", "exposed"]
    for name in ("zbv", "1f1b", "dualpipe"):
        r = rows[name]
        cells = table_row(out, name)
        assert cells[1:4] == [f"{r.result.makespan:g}", f"{r.at_end.makespan:g}", f"{exposed_sync(r.result):g}"]
    assert "sync at end: the same reductions after the step" in " ".join(out.split())


def test_compare_without_dp_sync_keeps_its_columns(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["compare", "-p", "4", "-m", "8"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "schedule" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][:3] == ["schedule", "makespan", "bubble"]


@needs_dot
def test_compare_image_with_dp_sync_draws_each_schedules_reductions(tmp_path, capsys):
    out = tmp_path / "c.svg"
    assert main(["compare", "-p", "4", "-m", "8", "--dp-sync", "2", "-o", str(out)]) == 0
    rows = [r for r in compare_results(4, 8, Costs(1, 1, 1), dp_sync=2.0) if r.result]
    boxes = svg_boxes(out, "reduce")
    want = sum(len(r.schedule.local_stages(rank)) for r in rows for rank in range(4))
    assert len(boxes) == want and all(key.startswith("reduce_p") for key in boxes)
    text = " ".join(svg_text(out).split())
    for r in rows:
        assert f"{r.label} · makespan {r.result.makespan:g}" in text
        assert f"exposed DP sync {max(r.result.dp_exposed):g}" in text
