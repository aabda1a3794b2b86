"""Data-parallel gradient reductions (REDUCE_GRAD) in every diagram: SVG/PNG lane, terminal row, trace thread."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from mt_dualpipe.schedules import Costs, add_grad_reduction, build_schedule, simulate
from mt_dualpipe.schedules.simulate import SimResult
from mt_dualpipe.visualize import Summary, render_file, terminal_view
from mt_dualpipe.visualize.terminal import plain_width
from tests.helpers.diagrams import needs_dot, render_text, svg_boxes, svg_groups, svg_text

R = "REDUCE_GRAD"
CASES = [("dualpipe", 4, 8), ("zbv", 4, 8), ("1f1b", 4, 6)]


def reduced(name: str, P: int, M: int, dp_sync: float = 3.0) -> tuple[object, SimResult]:
    schedule = add_grad_reduction(build_schedule(name, P, M))
    return schedule, simulate(schedule, Costs(1, 2, 1, dp_sync=dp_sync))


def reduce_events(res: SimResult) -> dict[int, list]:
    out: dict[int, list] = {}
    for e in sorted(res.timeline, key=lambda e: e.start):
        if e.op == R:
            out.setdefault(e.rank, []).append(e)
    return out


@needs_dot
@pytest.mark.parametrize("name,P,M", CASES)
def test_svg_one_labelled_reduce_box_per_stage_per_rank_to_scale(tmp_path, name, P, M):
    schedule, res = reduced(name, P, M)
    path = render_file(tmp_path / "d.svg", res.to_timeline(), schedule=schedule)
    ops = svg_boxes(path)
    boxes = svg_boxes(path, "reduce")
    compute = [e for e in res.timeline if e.lane == "compute"]
    assert len(ops) == len(compute)  # the compute boxes are unchanged
    events = reduce_events(res)
    # exactly one box per (rank, stage) the rank holds, ids in start order
    want = {f"reduce_r{r}_{i}": e for r, evs in events.items() for i, e in enumerate(evs)}
    assert set(boxes) == set(want)
    for r in range(P):
        assert sorted((e.chain, e.stage) for e in events[r]) == sorted(schedule.local_stages(r))
    # the compute boxes set the scale; each reduction sits on it: left at its start, width its duration
    t0, t1 = min(e.start for e in compute), max(e.end for e in compute)
    left_x, right_x = min(b[0] for b in ops.values()), max(b[1] for b in ops.values())
    scale = (right_x - left_x) / (t1 - t0)
    first = min(compute, key=lambda e: e.start)
    origin = left_x
    for key, (left, right) in boxes.items():
        e = want[key]
        assert left == pytest.approx(origin + (e.start - first.start) * scale, abs=0.2)
        assert right - left == pytest.approx(e.duration * scale, abs=0.2)
    # the last reduction ends the step: its right edge is the makespan on the same scale
    assert max(r for _, r in boxes.values()) == pytest.approx(origin + res.makespan * scale, abs=0.2)
    groups = {g.get("id"): g for g in svg_groups(path, "reduce")}
    for key, e in want.items():
        assert f"stage{e.stage}" in groups[key].get("class").split()
        assert "".join(groups[key].itertext()).strip().endswith(f"R/s{e.stage}")  # labelled (tooltip + text)
    text = svg_text(path)
    assert f"exposed DP sync {max(res.dp_exposed):g}" in text
    for r in range(P):
        assert f"dp sync exposed {res.dp_exposed[r]:g}" in text
    assert "data-parallel gradient reduction" in text


@needs_dot
def test_png_with_reductions_is_taller_by_one_lane_per_rank(tmp_path):
    from mt_dualpipe.visualize.gantt import REDUCE_H
    from mt_dualpipe.visualize.render import drawing_size

    plain = simulate(build_schedule("zbv", 4, 8), Costs(1, 2, 1)).to_timeline()
    _, res = reduced("zbv", 4, 8)
    w0, h0 = drawing_size(plain)
    w1, h1 = drawing_size(res.to_timeline())
    assert h1 - h0 == pytest.approx(4 * REDUCE_H + 15, abs=3)  # a lane per rank and a legend line
    assert Path(render_file(tmp_path / "d.png", res.to_timeline())).read_bytes()[:4] == b"\x89PNG"


def test_summary_from_events_matches_the_simulator_with_reductions():
    for name, P, M in CASES:
        _, res = reduced(name, P, M)
        got, want = Summary.from_timeline(res.to_timeline()), Summary.from_sim(res)
        assert got.makespan == want.makespan == res.makespan
        assert got.dp_exposed == pytest.approx(res.dp_exposed) and want.dp_exposed == res.dp_exposed
        assert got.bubble_rate == pytest.approx(res.bubble_rate)
    plain = simulate(build_schedule("zbv", 4, 8), Costs(1, 2, 1))
    assert Summary.from_sim(plain).dp_exposed == [] == Summary.from_timeline(plain.to_timeline()).dp_exposed


@pytest.mark.parametrize("name,P,M", CASES)
def test_terminal_plain_row_per_rank_with_each_stage_reduction_at_its_time(name, P, M):
    schedule, res = reduced(name, P, M)
    tl = res.to_timeline()
    width = plain_width(tl)
    lines = render_text(terminal_view(tl, metrics=res, plain=True), width, styles=False).splitlines()
    comm = [line for line in lines if line.startswith(" ") and "╎" in line]
    assert len(comm) == P
    label_w = len(f"r{P - 1}") + 1
    ncols = width - label_w - 2 - len("   idle  peak")
    scale = ncols / res.makespan
    events = reduce_events(res)
    for r, line in enumerate(comm):
        cells = line[label_w + 1:label_w + 1 + ncols]
        tokens = [(i, t) for i, t in enumerate(cells) if t == "R"]
        assert [f"R/s{e.stage}" for e in events[r]] == [cells[i:i + 4] for i, _ in tokens]
        assert [i for i, _ in tokens] == [min(round(e.start * scale), ncols) for e in events[r]]
        assert line.rstrip().endswith(f"+{res.dp_exposed[r]:g} dp")
    per_rank = " ".join(f"{x:g}" for x in res.dp_exposed)
    assert f"exposed DP sync {max(res.dp_exposed):g} (per rank: {per_rank})" in lines[-1]
    assert lines[-2].startswith(f"makespan {res.makespan:g} ")
    assert "R/s3 stage 3's data-parallel gradient reduction" in "\n".join(lines)  # the legend


def test_terminal_colour_view_draws_the_comm_row_in_the_reduce_colour():
    from mt_dualpipe.visualize.style import REDUCE_COLOUR

    _, res = reduced("dualpipe", 4, 8)
    view = terminal_view(res.to_timeline(), width=120, metrics=res)
    console = Console(width=120, color_system="truecolor", force_terminal=True, file=io.StringIO())
    segments = [s for s in console.render(view) if s.style and s.style.bgcolor]
    reduce_bg = [s for s in segments if "#{:02x}{:02x}{:02x}".format(*s.style.bgcolor.triplet) == REDUCE_COLOUR]
    assert reduce_bg and all("R/s" in s.text for s in reduce_bg)
    # every reduction is its own coloured cell (touching ones alternate shade), labelled with its stage
    n = sum(len(v) for v in reduce_events(res).values())
    assert sum(s.text.count("R/s") for s in segments) == n + 1  # and the legend's swatch, R/s3
    assert sum(s.text.split().count("R/s2") for s in segments) == 2  # stage 2 lives on ranks 1 and 2


def test_trace_has_one_reduce_slice_per_stage_per_rank_on_the_comm_thread(tmp_path):
    schedule, res = reduced("dualpipe", 4, 8)
    data = json.loads(Path(render_file(tmp_path / "t.json", res.to_timeline())).read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X" and e["cat"] == R]
    assert all(e["tid"] == 1 for e in slices)
    got = sorted((e["pid"], e["args"]["chain"], e["args"]["stage"], e["ts"], e["dur"], e["name"]) for e in slices)
    want = sorted((e.rank, e.chain, e.stage, e.start * 1000.0, e.duration * 1000.0, f"{R} R/s{e.stage}")
                  for e in res.timeline if e.op == R)
    assert got == want
    assert len(slices) == sum(len(schedule.local_stages(r)) for r in range(4))
    compute = sum(e["ph"] == "X" and e["tid"] == 0 for e in data["traceEvents"])
    assert compute == build_schedule("dualpipe", 4, 8).num_ops()


def test_dependency_graph_labels_each_reduction_with_its_stage():
    from mt_dualpipe.visualize.depgraph import dependency_source

    schedule = add_grad_reduction(build_schedule("zbv", 2, 4))
    nodes = [line for line in dependency_source(schedule).splitlines() if 'class="op REDUCE_GRAD' in line]
    labels = sorted(line.split("label=")[1].split(" ")[0] for line in nodes)
    assert labels == sorted(f'"R/s{s}"' for r in range(2) for _, s in schedule.local_stages(r))
