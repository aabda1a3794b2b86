"""The schedule commands of the CLI: list, show, compare, export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mt_dualpipe.schedules import (
    Schedule,
    build_schedule,
)

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "golden"
if not GOLDEN.exists():  # CI clones main next to a copy of shared/
    GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"



# ---------------------------------------------------------------- command line ---------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mt_dualpipe", *args], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def test_cli_list_show_compare_export(tmp_path: Path) -> None:
    out = run_cli("list")
    assert out.returncode == 0 and "dualpipev" in out.stdout and "M >= 2P" in out.stdout
    out = run_cli("show", "dualpipe", "-p", "8", "-m", "20")
    assert out.returncode == 0 and "makespan 66" in out.stdout and "9.09 %" in out.stdout
    out = run_cli("compare", "-p", "8", "-m", "20")
    assert out.returncode == 0 and "dualpipe" in out.stdout and "★" in out.stdout
    path = tmp_path / "s.json"
    out = run_cli("export", "dualpipe", "-p", "4", "-m", "8", "-o", str(path))
    assert out.returncode == 0, out.stderr
    assert Schedule.from_json(path.read_text()).ranks == build_schedule("dualpipe", 4, 8).ranks
    out = run_cli("show", "dualpipe", "-p", "5", "-m", "20")
    assert out.returncode == 2 and "dualpipe needs an even number of ranks, got 5" in out.stderr
    for sub in ("list", "show", "compare", "export"):
        assert run_cli(sub, "--help").returncode == 0
