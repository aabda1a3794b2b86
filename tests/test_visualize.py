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
from pathlib import Path

import pytest
from rich.console import Console

from mt_dualpipe.cli import main as cli_main
from mt_dualpipe.schedules import Costs, ScheduleError, accepts, build_schedule, list_schedules, simulate
from mt_dualpipe.schedules.ir import compute_parts
from mt_dualpipe.schedules.timeline import Timeline, TimelineEvent
from mt_dualpipe.visualize import (
    GraphvizNotFound,
    Summary,
    costs_from_timeline,
    dependency_graph,
    render_comparison,
    render_file,
    terminal_view,
)
from mt_dualpipe.visualize.depgraph import dependencies
from mt_dualpipe.visualize.render import drawing_size

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
SVG = "{http://www.w3.org/2000/svg}"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` not installed (.ci/run installs it)")


def sim(name: str, P: int, M: int, costs: Costs | None = None):
    return simulate(build_schedule(name, P, M), costs or Costs(1, 1, 1))


def measured(name: str = "dualpipe", P: int = 4, M: int = 8) -> tuple[Timeline, int]:
    """A recorded-run lookalike: seconds from an arbitrary origin, plus a SEND_F after each non-last F."""
    res = sim(name, P, M, Costs(2, 3, 1))
    schedule = build_schedule(name, P, M)
    last = schedule.num_stages() - 1
    events, comms = [], 0
    for e in res.timeline:
        events.append(e._replace(start=100.0 + e.start * 0.01, end=100.0 + e.end * 0.01))
        if e.op == "F" and e.stage < last:
            end = 100.0 + e.end * 0.01
            events.append(TimelineEvent(e.rank, "SEND_F", e.chain, e.stage, e.mb, end, end + 0.002, lane="comm"))
            comms += 1
    return Timeline(name, P, M, events, "measured"), comms


def svg_boxes(path: str, cls: str = "op") -> dict[str, tuple[float, float]]:
    """id -> (left x, right x) in points of every <g> whose class has token ``cls``."""
    root = ET.parse(path).getroot()
    graph = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "graph")
    zoom = float(re.match(r"scale\(([\d.]+)", graph.get("transform")).group(1))
    out = {}
    for g in root.iter(f"{SVG}g"):
        if cls in g.get("class", "").split():
            poly = next(g.iter(f"{SVG}polygon"))
            xs = [float(p.split(",")[0]) * zoom for p in poly.get("points").split()]
            assert g.get("id") not in out
            out[g.get("id")] = (min(xs), max(xs))
    return out


def svg_text(path: str) -> str:
    """All text drawn in an SVG, one line per <text> element."""
    return "\n".join("".join(t.itertext()) for t in ET.parse(path).getroot().iter(f"{SVG}text"))


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
def render_text(renderable, width: int, styles: bool) -> str:
    console = Console(width=width, record=True, color_system="truecolor", force_terminal=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text(styles=styles)


@pytest.mark.parametrize("styles,suffix", [(False, "txt"), (True, "ansi")])
def test_terminal_matches_snapshot(styles, suffix):
    res = sim("dualpipe", 4, 8)
    out = render_text(terminal_view(res.to_timeline(), width=100, metrics=res), 100, styles)
    snap = SNAPSHOTS / f"terminal_dualpipe_P4_M8_w100.{suffix}"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snap.write_text(out, encoding="utf-8")
    assert out == snap.read_text(encoding="utf-8")


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


# ---------------------------------------------------------------------------------------------- CLI, example
def test_cli_render_schedule_and_timeline(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert cli_main(["render", "dualpipev", "-p", "4", "-m", "8", "--costs", "1,2,1", "-o", str(out)]) == 0
    slices = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    res = sim("dualpipev", 4, 8, Costs(1, 2, 1))
    assert len(slices) == len(res.timeline) and max(e["ts"] + e["dur"] for e in slices) == res.makespan * 1000
    tl, _ = measured()
    run = tmp_path / "run.json"
    run.write_text(tl.to_json())
    trace = tmp_path / "run_trace.json"
    assert cli_main(["render", "--timeline", str(run), "-o", str(trace), "--against", "dualpipe"]) == 0
    names = [e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "process_name"]
    assert names[0] == "measured / rank 0" and names[-1] == "simulated / rank 3"
    # the simulation (costs measured from the run) is in the run's seconds: same makespan in the trace
    ends = {}
    for e in json.loads(trace.read_text())["traceEvents"]:
        if e["ph"] == "X" and e["tid"] == 0:
            ends[e["pid"] // 4] = max(ends.get(e["pid"] // 4, 0.0), e["ts"] + e["dur"])
    assert ends[0] == pytest.approx(ends[1]) == pytest.approx(tl.makespan * 1e6)
    capsys.readouterr()


@pytest.mark.parametrize("argv,message", [
    (["render", "-o", "x.svg"], "needs a schedule NAME (with -p and -m) or --timeline run.json"),
    (["render", "dualpipe", "-o", "x.svg"], "render dualpipe needs -p RANKS and -m MICROBATCHES"),
    (["render", "dualpipe", "-p", "4", "-m", "8", "--against", "dualpipe"], "--against NAME draws a simulation"),
    (["render", "--timeline", "missing.json", "-o", "x.svg"], "cannot read timeline 'missing.json'"),
    (["render", "dualpipe", "-p", "4", "-m", "8", "--virtual-stages", "2"], "--virtual-stages applies to"),
])
def test_cli_render_errors(argv, message, capsys):
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_render_terminal_without_output(capsys):
    assert cli_main(["render", "dualpipe", "-p", "4", "-m", "8", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert "makespan 26 · bubble rate 7.69%" in out and out.count("│") == 8


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
