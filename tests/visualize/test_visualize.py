"""Diagrams: SVG boxes per op and to scale, PNG size, trace JSON times and flows, terminal snapshot, no-dot message."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from mt_dualpipe.cli import main as cli_main
from mt_dualpipe.schedules import Costs, ScheduleError, accepts, build_schedule, list_schedules, simulate
from mt_dualpipe.schedules.ir import compute_parts
from mt_dualpipe.schedules.timeline import TimelineEvent
from mt_dualpipe.visualize import (
    GraphvizNotFound,
    Summary,
    chrome_trace,
    costs_from_timeline,
    dependency_graph,
    render_comparison,
    render_file,
    terminal_view,
)
from mt_dualpipe.visualize.depgraph import dependencies
from mt_dualpipe.visualize.render import drawing_size
from mt_dualpipe.visualize.terminal import plain_width
from tests.helpers.diagrams import ROOT, SVG, measured, needs_dot, render_text, sim, svg_boxes, svg_groups, svg_text

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def png_size(data: bytes) -> tuple[int, int]:
    """Decode a PNG far enough to prove it is one: signature, IHDR, and the inflated pixel rows."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour_type = ihdr[:4]
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour_type]
    assert len(zlib.decompress(idat)) == height * (1 + width * channels * depth // 8)
    return width, height


# ---------------------------------------------------------------------------------------------- SVG / PNG
@needs_dot
@pytest.mark.parametrize("name,P,M", [("dualpipe", 4, 8), ("dualpipev", 4, 10)])
def test_svg_one_box_per_op_drawn_to_scale(tmp_path, name, P, M):
    schedule = build_schedule(name, P, M)
    res = simulate(schedule, Costs(1, 2, 1))
    path = render_file(tmp_path / "d.svg", res.to_timeline(), schedule=schedule)
    boxes = svg_boxes(path)
    assert len(boxes) == schedule.num_ops()
    # box left edge = origin + start * scale, width = duration * scale, for every op
    events = {}
    per_rank: dict[int, list[TimelineEvent]] = {}
    for e in res.timeline:
        per_rank.setdefault(e.rank, []).append(e)
    for r, evs in per_rank.items():
        for i, e in enumerate(sorted(evs, key=lambda e: e.start)):
            events[f"op_r{r}_{i}"] = e
    assert set(events) == set(boxes)
    left_x, right_x = min(b[0] for b in boxes.values()), max(b[1] for b in boxes.values())
    scale = (right_x - left_x) / res.makespan
    origin = left_x - min(e.start for e in res.timeline) * scale
    for key, (left, right) in boxes.items():
        assert left == pytest.approx(origin + events[key].start * scale, abs=0.2)  # points
        assert right - left == pytest.approx(events[key].duration * scale, abs=0.2)
    text = svg_text(path)
    assert f"bubble rate {100 * res.bubble_rate:.2f}%" in text and f"P={P} M={M}" in text
    assert f"idle {100 * res.makespan_bubble[0] / res.makespan:.1f}%" in text


@needs_dot
def test_png_decodes_with_expected_size(tmp_path):
    res = sim("dualpipe", 4, 8)
    tl = res.to_timeline()
    path = render_file(tmp_path / "d.png", tl)
    width_pt, height_pt = drawing_size(tl)
    assert width_pt > 640 and height_pt > 4 * 19  # the time axis and four rank rows at least
    assert png_size(Path(path).read_bytes()) == (width_pt * 96 // 72, height_pt * 96 // 72)
    svg = render_file(tmp_path / "d.svg", tl)
    root = ET.parse(svg).getroot()
    assert (root.get("width"), root.get("height")) == (f"{width_pt}pt", f"{height_pt}pt")


@needs_dot
def test_comparison_stacks_every_schedule_on_one_scale(tmp_path):
    entries = [(i.name, sim(i.name, 4, 8)) for i in list_schedules()
               if i.name != "auto" and accepts(i.name, 4, 8) is None]
    assert {"dualpipe", "dualpipev"} <= {n for n, _ in entries}
    path = render_comparison(tmp_path / "c.svg", entries)
    boxes = svg_boxes(path)
    assert len(boxes) == sum(len(r.timeline) for _, r in entries)
    # one scale: every unit-cost F box has the same width in every panel
    widths = {round(right - left, 2) for (left, right) in boxes.values()}
    f_width = min(widths)
    assert all(w == pytest.approx(f_width * round(w / f_width), abs=0.2) for w in widths)
    text = svg_text(path)
    for label, res in entries:
        assert f"{label} · makespan {res.makespan:g} · bubble rate {100 * res.bubble_rate:.2f}% · " \
               f"peak activations {max(res.peak_activations)}" in text


@needs_dot
def test_measured_run_with_comm_lane_and_simulation_beneath(tmp_path):
    tl, comms = measured()
    against = sim("dualpipe", 4, 8, costs_from_timeline(tl)).to_timeline()
    path = render_file(tmp_path / "m.svg", tl, against=against)
    n_ops = build_schedule("dualpipe", 4, 8).num_ops()
    assert len(svg_boxes(path)) == 2 * n_ops
    assert len(svg_boxes(path, "comm")) == comms
    text = svg_text(path)
    assert "measured: dualpipe" in text and "simulated: dualpipe" in text


def test_costs_from_timeline_recovers_measured_means():
    tl, _ = measured()
    costs = costs_from_timeline(tl)
    assert (costs.f, costs.b, costs.w) == pytest.approx((0.02, 0.03, 0.01))
    assert costs.fb == pytest.approx(0.06)  # F + B + W: FB units of the simulation that made the run
    # the simulation of the same schedule with those costs has the run's makespan
    assert sim("dualpipe", 4, 8, costs).makespan == pytest.approx(tl.makespan)


# ---------------------------------------------------------------------------------------------- trace
def test_trace_has_one_complete_event_per_op_with_times_and_flows(tmp_path):
    schedule = build_schedule("dualpipev", 4, 10)
    res = simulate(schedule, Costs(1, 2, 1))
    data = json.loads(Path(render_file(tmp_path / "t.json", res.to_timeline())).read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == schedule.num_ops()
    got = sorted((e["pid"], e["ts"], e["dur"], e["args"]["mb"]) for e in slices)
    want = sorted((e.rank, e.start * 1000.0, (e.end - e.start) * 1000.0, e.mb) for e in res.timeline)
    assert got == [pytest.approx(w) for w in want]
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    # one flow per cross-rank hop: forward and backward, for each micro-batch
    chain = schedule.placement[0]
    hops = sum(chain[s] != chain[s + 1] for s in range(len(chain) - 1))
    starts = [e for e in data["traceEvents"] if e["ph"] == "s"]
    ends = {e["id"]: e for e in data["traceEvents"] if e["ph"] == "f"}
    assert len(starts) == len(ends) == 2 * hops * 10
    for s in starts:
        assert s["pid"] != ends[s["id"]]["pid"]


def test_trace_of_measured_run_uses_seconds_and_a_comm_thread(tmp_path):
    tl, comms = measured()
    data = json.loads(Path(render_file(tmp_path / "t.json", tl)).read_text())
    compute = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    comm = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert len(compute) == build_schedule("dualpipe", 4, 8).num_ops() and len(comm) == comms
    first = min(tl.events, key=lambda e: e.start)
    assert min(e["ts"] for e in compute) == 0.0
    e = next(e for e in tl.events if e.lane == "compute" and e.op == "FB")
    match = [x for x in compute if x["pid"] == e.rank and x["ts"] == pytest.approx((e.start - first.start) * 1e6)]
    assert len(match) == 1 and match[0]["dur"] == pytest.approx((e.end - e.start) * 1e6)
    assert match[0]["args"]["pair"]["mb"] == e.pair[3]


def test_comparison_trace_names_each_schedule(tmp_path):
    entries = [("dualpipe", sim("dualpipe", 4, 8)), ("dualpipev", sim("dualpipev", 4, 8))]
    data = json.loads(Path(render_comparison(tmp_path / "c.json", entries)).read_text())
    names = [e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"]
    assert names == [f"dualpipe / rank {r}" for r in range(4)] + [f"dualpipev / rank {r}" for r in range(4)]
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) == sum(len(r.timeline) for _, r in entries)


# ---------------------------------------------------------------------------------------------- terminal
@pytest.mark.parametrize("name,plain,width", [("dualpipe", False, 100), ("dualpipe", True, 100), ("zbv", True, None)])
def test_terminal_matches_snapshot(name, plain, width):
    """Colour view (.ansi, with its escape codes) and the plain view a pipe gets (.txt, no colour;
    without a width it is made wide enough for each op's text)."""
    res = sim(name, 4, 8)
    view = terminal_view(res.to_timeline(), width=width, metrics=res, plain=plain)
    out = render_text(view, width or plain_width(res.to_timeline()), styles=not plain)
    snap = SNAPSHOTS / f"terminal_{name}_P4_M8_w{width or 'auto'}.{'txt' if plain else 'ansi'}"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snap.write_text(out, encoding="utf-8")
    assert out == snap.read_text(encoding="utf-8")
    if plain:
        assert "\x1b[" not in out


def test_terminal_content_width_colours_and_metrics():
    res = sim("dualpipe", 4, 8)
    view = terminal_view(res.to_timeline(), width=90, metrics=res)
    plain = render_text(view, 200, styles=False).splitlines()
    assert all(len(line) <= 90 for line in plain)
    rows = [line for line in plain if line.startswith("r")]
    assert len(rows) == 4 and all(line.count("│") == 2 for line in rows)
    assert "3+5" in rows[0]  # an FB pair is one unit labelled with both micro-batches
    assert plain[-1] == "makespan 26 · bubble rate 7.69% · peak activations 5 (per rank: 5 5 5 5)"
    # chain 1's forward cells are styled differently from chain 0's
    console = Console(width=90, color_system="truecolor", force_terminal=True, file=io.StringIO())
    segments = list(console.render(view))
    f0 = {str(s.style.bgcolor.triplet) for s in segments if s.text.strip() == "0" and s.style and s.style.bgcolor}
    f4 = {str(s.style.bgcolor.triplet) for s in segments if s.text.strip() == "4" and s.style and s.style.bgcolor}
    assert f0 and f4 and not f0 & f4


def test_terminal_metrics_computed_from_events_match_simulator():
    for name, P, M in [("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zb-h1", 4, 8)]:
        res = sim(name, P, M, Costs(1, 2, 1))
        got, want = Summary.from_timeline(res.to_timeline()), Summary.from_sim(res)
        assert got.makespan == want.makespan and got.peak_activations == want.peak_activations
        assert got.bubble == pytest.approx(want.bubble) and got.bubble_rate == pytest.approx(want.bubble_rate)


def test_large_schedule_terminal_and_trace_fast_and_summarised(tmp_path):
    res = sim("dualpipe", 64, 1024)
    tl = res.to_timeline()
    t = time.perf_counter()
    lines = render_text(terminal_view(tl, width=120, metrics=res), 120, styles=False).splitlines()
    assert time.perf_counter() - t < 10
    assert len(lines) <= 32 + 8 and any("32 more ranks (r16..r47)" in line for line in lines)
    assert all(len(line) <= 120 for line in lines)
    t = time.perf_counter()
    render_file(tmp_path / "big.json", tl)
    assert time.perf_counter() - t < 20


@pytest.mark.slow
@needs_dot
def test_large_schedule_svg_in_seconds(tmp_path):
    res = sim("zb-h1", 64, 1024)
    t = time.perf_counter()
    path = render_file(tmp_path / "big.svg", res.to_timeline())
    assert time.perf_counter() - t < 60
    assert Path(path).read_text().count('class="node op ') == 64 * 1024 * 3


# ---------------------------------------------------------------------------------------------- dependency graph
@needs_dot
def test_dependency_graph_draws_every_op_and_wait(tmp_path):
    schedule = build_schedule("dualpipe", 4, 8)
    path = dependency_graph(schedule, tmp_path / "deps.svg")
    groups = list(ET.parse(path).getroot().iter(f"{SVG}g"))
    nodes = {g.get("id") for g in groups if "op" in g.get("class", "").split()}
    assert nodes == {f"op_r{r}_{i}" for r, i, _ in schedule.iter_ops()}
    edges = [g for g in groups if "dep" in g.get("class", "").split()]
    # per micro-batch: S-1 activations, S saved activations, S-1 gradients; plus one B -> W per W op
    S = schedule.num_stages()
    n_w = sum(p.kind == "W" for ops in schedule.ranks for item in ops for p in compute_parts(item))
    assert len(edges) == len(dependencies(schedule)) == 8 * (3 * S - 2) + n_w
    assert sum("cross-rank" in g.get("class") for g in edges) == 8 * 2 * (S - 1)


def test_dependency_graph_of_a_deadlocked_schedule_uses_list_order(tmp_path):
    schedule = build_schedule("gpipe", 2, 2)
    schedule.ranks[0] = [schedule.ranks[0][i] for i in (0, 2, 1, 3)]  # BW0 before F1: rank 1 never gets F1
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule, Costs())
    text = Path(dependency_graph(schedule, tmp_path / "d.dot")).read_text()
    assert "list order (the schedule cannot be simulated)" in text
    # rank 0's BW0 waits for rank 1's BW0 (cross-rank gradient), which waits for F0 on rank 1
    assert re.search(r'^op_r1_2 -> op_r0_1 \[class="dep gradient cross-rank"', text, re.M)


def test_dependency_graph_refuses_large_schedules(tmp_path):
    with pytest.raises(ScheduleError, match=r"at most 600 ops\); dualpipe with P=8 M=64 has \d+: use fewer"):
        dependency_graph(build_schedule("dualpipe", 8, 64), tmp_path / "d.svg")


def test_dependency_graph_dot_source_without_graphviz(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    schedule = build_schedule("dualpipev", 2, 4)
    text = Path(dependency_graph(schedule, tmp_path / "d.dot")).read_text()
    assert text.startswith("digraph dependencies") and text.count('class="op ') == schedule.num_ops()
    assert len(re.findall(r"^op_r\d+_\d+ -> op_r\d+_\d+ ", text, re.M)) == len(dependencies(schedule))


# ---------------------------------------------------------------------------------------------- missing dot
def test_missing_dot_one_line_hint_while_json_and_terminal_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    tl = sim("dualpipe", 4, 8).to_timeline()
    with pytest.raises(GraphvizNotFound) as err:
        render_file(tmp_path / "d.svg", tl)
    msg = str(err.value)
    assert "\n" not in msg and "`dot`" in msg and "apt-get install graphviz" in msg
    assert not (tmp_path / "d.svg").exists()
    assert json.loads(Path(render_file(tmp_path / "d.json", tl)).read_text())["traceEvents"]
    assert "makespan 26" in render_text(terminal_view(tl, width=100), 100, styles=False)
    assert cli_main(["render", "dualpipe", "-p", "4", "-m", "8", "-o", str(tmp_path / "x.png")]) == 3
    assert capsys.readouterr().err == f"mt-dualpipe: {msg}\n"


def test_bad_extension_names_the_allowed_ones(tmp_path):
    with pytest.raises(ScheduleError, match=r"extension must be one of \.svg, \.png, \.pdf, \.dot, \.gv, \.json"):
        render_file(tmp_path / "d.bmp", sim("dualpipe", 4, 8).to_timeline())


def test_visualize_never_imports_the_runtime_or_torch():
    code = ("import sys, mt_dualpipe.visualize, mt_dualpipe.cli.render_cmd; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('mt_dualpipe.runtime')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@needs_dot
def test_example_writes_comparison_and_prints_table(tmp_path):
    out = tmp_path / "cmp.svg"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "bubble_diagrams.py"), "-o", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120"))
    assert proc.returncode == 0, proc.stderr
    assert "P=8 M=20" in proc.stdout and "│ dualpipe  │       66 │      9.09 % │" in proc.stdout
    boxes = svg_boxes(str(out))
    assert len(boxes) >= build_schedule("dualpipe", 8, 20).num_ops() + build_schedule("dualpipev", 8, 20).num_ops()


# ---------------------------------------------------------------------------------------------- a rank's two stages
@needs_dot
def test_svg_tells_a_v_schedules_two_stages_apart(tmp_path):
    schedule = build_schedule("zbv", 4, 8)
    res = simulate(schedule, Costs(1, 1, 1))
    path = render_file(tmp_path / "zbv.svg", res.to_timeline(), schedule=schedule)
    fills: dict[tuple[int, str, int], set[str]] = {}
    for g in svg_groups(path, "op"):
        classes = g.get("class").split()
        stage = int(next(c for c in classes if c.startswith("stage"))[5:])
        rank = int(g.get("id").split("_")[1][1:])
        kind = classes[classes.index("op") + 1]
        assert "".join("".join(t.itertext()) for t in g.iter(f"{SVG}text")).endswith(f"s{stage}")
        fills.setdefault((rank, kind, stage), set()).add(next(g.iter(f"{SVG}polygon")).get("fill"))
    # rank 0 runs stage 0 going down and stage 7 coming back: same kind, its own colour for each
    for kind in ("F", "B", "W"):
        assert len(fills[(0, kind, 0)]) == len(fills[(0, kind, 7)]) == 1
        assert fills[(0, kind, 0)] != fills[(0, kind, 7)]
    assert "the rank's second stage (chain 1, a V's way back, the next chunk)" in svg_text(path)


def test_dot_labels_only_multi_stage_ranks_with_their_stage(tmp_path):
    for name, expect in (("dualpipev", True), ("1f1b", False)):
        res = sim(name, 2, 4)
        text = Path(render_file(tmp_path / f"{name}.dot", res.to_timeline())).read_text()
        assert bool(re.search(r'label="\d+\\ns\d+"', text)) is expect, name


# ---------------------------------------------------------------------------------------------- one rule for deps
def test_depgraph_and_trace_follow_the_op_rules(monkeypatch):
    """Change what W waits for in ``schedules.ops`` and both diagrams change with it: they derive nothing."""
    from mt_dualpipe.schedules import ops

    schedule = build_schedule("zb-h1", 2, 2)
    before = dependencies(schedule)
    flows_before = sum(e["ph"] == "s" for e in chrome_trace([(None, sim("zb-h1", 2, 2).to_timeline())])["traceEvents"])
    # hypothetical rule: W also waits for the activation of the previous stage (made on the other rank)
    w = ops.RULES[ops.W]
    monkeypatch.setitem(ops.RULES, ops.W, replace(w, needs=w.needs + ((ops.ACT, -1),)))
    after = dependencies(schedule)
    extra = [d for d in after if d not in before]
    where = {(r, i): item for r, i, item in schedule.iter_ops()}
    assert len(extra) == 2 and all(where[dst].kind == "W" and where[dst].stage == 1 and where[src].kind == "F"
                                   and where[src].stage == 0 and kind == "activation" for src, dst, kind in extra)
    flows = sum(e["ph"] == "s" for e in chrome_trace([(None, sim("zb-h1", 2, 2).to_timeline())])["traceEvents"])
    assert flows == flows_before + 2
