"""``mt-dualpipe render``: schedules and recorded runs to trace files and the terminal, and its errors."""

from __future__ import annotations

import json

import pytest

from mt_dualpipe.cli import main as cli_main
from mt_dualpipe.schedules import Costs
from tests.helpers.diagrams import measured, sim


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


