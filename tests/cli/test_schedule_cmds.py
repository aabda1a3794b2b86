"""``show``, ``compare`` and ``export``: stage labels, plain text for pipes, the comparison image and
its table agreeing, schedules left out with their reason, the auto lower bound, export formats."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

from mt_dualpipe.cli import main
from mt_dualpipe.schedules import Costs, build_schedule, simulate
from tests.helpers.diagrams import ROOT, needs_dot, svg_text

ANSI = re.compile(r"\x1b\[")


def run_cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    """The command as a user runs it with its output piped (not a terminal)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS=str(columns))
    env.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "mt_dualpipe", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_show_names_each_ops_stage_and_reads_without_colour():
    out = run_cli("show", "zbv", "-p", "2", "-m", "4")
    assert out.returncode == 0, out.stderr
    assert not ANSI.search(out.stdout)
    rank0 = out.stdout[out.stdout.index("rank 0"):out.stdout.index("rank 1")].split()
    # a V: rank 0 runs stage 0 on the way down and stage 3 on the way back; both forwards of micro-batch 0
    assert rank0[2:6] == ["F0/s0", "F1/s0", "F2/s0", "F0/s3"]
    assert rank0.count("F0/s0") == rank0.count("F0/s3") == 1
    # the timeline as text: kind and micro-batch per op, ' on the rank's second stage
    row = next(line for line in out.stdout.splitlines() if line.startswith("r0 │"))
    assert row.startswith("r0 │F0..F1..F2..F0'.B0'.W0'.")
    assert "' the rank's second stage (chain 1, a V's way back, the next chunk)" in out.stdout


def test_show_of_a_linear_schedule_keeps_plain_tokens():
    out = run_cli("show", "1f1b", "-p", "2", "-m", "3")
    assert out.returncode == 0
    rank0 = out.stdout[out.stdout.index("rank 0"):out.stdout.index("rank 1")].split()
    assert rank0[2:] == ["F0", "F1", "b0", "F2", "b1", "b2"]  # one stage per rank: no stage to tell apart


@functools.cache
def _auto_4x8():
    """What ``show``/``compare`` run for ``auto -p 4 -m 8 --costs 1,2,1`` (built once for both tests)."""
    return build_schedule("auto", 4, 8, costs=Costs(1, 2, 1))


def test_show_auto_gives_its_lower_bound_and_gap(capsys):
    assert main(["show", "auto", "-p", "4", "-m", "8", "--costs", "1,2,1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    sched = _auto_4x8()
    makespan = simulate(sched, Costs(1, 2, 1)).makespan
    bound = sched.meta["lower_bound"]
    assert bound > 0
    assert (f"lower bound {bound:g} (no order on this placement is faster, memory ignored); makespan {makespan:g} "
            f"is {100 * (makespan / bound - 1):.2f} % above it") in out


def test_compare_lists_left_out_schedules_with_the_reason_and_fits_80_columns():
    out = run_cli("compare", "-p", "4", "-m", "10", columns=80)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "…" not in out.stdout  # nothing cut: headers and cells wrap instead
    header = next(line for line in lines if line.startswith("┃ schedule"))
    assert [h.strip() for h in header.strip("┃").split("┃")] == ["schedule", "makespan", "bubble", "peak", "stages",
                                                                 "params"]
    first_column = " ".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert ("interleaved-1f1b (v=2): not run, interleaved-1f1b needs num_microbatches divisible by num_ranks (4), "
            "got 10") in first_column
    assert re.search(r"│ zbv ★ +│ +31\.5 │ +4\.76 % │ +4 │ +8 │ +1× │", out.stdout)


def test_compare_auto_shows_its_lower_bound_and_gap(capsys):
    assert main(["compare", "-p", "4", "-m", "8", "--costs", "1,2,1", "--auto"]) == 0
    out = capsys.readouterr().out
    sched = _auto_4x8()
    makespan = simulate(sched, Costs(1, 2, 1)).makespan
    bound = sched.meta["lower_bound"]
    assert "bound (gap)" in out
    assert re.search(rf"│ auto +│ +{makespan:g} │.*│ {bound:g} \(\+{100 * (makespan / bound - 1):.1f} %\) │", out)


@needs_dot
def test_compare_image_agrees_with_its_table(tmp_path, capsys):
    path = tmp_path / "cmp.svg"
    assert main(["compare", "-p", "4", "-m", "10", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"│ ([a-z0-9-]+(?: \(v=2\))?)( ★)? +│ +([\d.]+) │ +([\d.]+) % │ +([\d.]+) │", out)
    assert [r[0] for r in rows] == ["zbv", "dualpipe", "zb-h1", "dualpipev", "zb-h2", "1f1b", "gpipe"]
    headers = [line for line in svg_text(path).splitlines() if " · makespan " in line]
    want = [f"{'★ ' if best else ''}{label} · makespan {makespan} · bubble rate {bubble}% · peak activations {peak}"
            for label, best, makespan, bubble, peak in rows]
    assert headers == want  # same order, same numbers, same units, the best marked
    assert "peak activations 4.5" in svg_text(path)  # dualpipev: 9 half-size stages = 4.5 full ones, as in the table
    text = svg_text(path)
    assert "★ lowest makespan · peak activations: the most loaded rank, in full-size stages" in text
    assert "not run (see the table): interleaved-1f1b (v=2)" in text


def test_export_refuses_an_unknown_extension(tmp_path, capsys):
    path = tmp_path / "x.txt"
    assert main(["export", "dualpipe", "-p", "4", "-m", "8", "-o", str(path)]) == 2
    assert capsys.readouterr().err == (f"mt-dualpipe: error: cannot tell the format of {str(path)!r} from its "
                                       "extension .txt: use a file ending in .json or .csv, or give --format "
                                       "json|csv\n")
    assert not path.exists()
    assert main(["export", "zbv", "-p", "4", "-m", "8", "-o", str(path), "--format", "csv"]) == 0
    assert path.read_text() == build_schedule("zbv", 4, 8).to_pipelining_csv()
