"""The top-level package: subpackages resolve lazily, and the schedule compiler never loads torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mt_dualpipe.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_subpackages_resolve_lazily_without_torch():
    out = run("import sys, mt_dualpipe as md\n"
              "assert 'mt_dualpipe.schedules' not in sys.modules\n"
              "s = md.schedules.build_schedule('dualpipe', 4, 8)\n"
              "print(s.num_ops(), md.visualize.terminal_view.__name__, md.planner.plan.__name__)\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
              "print('schedules' in dir(md), 'runtime' in dir(md))")
    assert out.returncode == 0, out.stderr
    ops = build_schedule("dualpipe", 4, 8).num_ops()
    assert out.stdout.splitlines() == [f"{ops} terminal_view plan", "[]", "True True"]


def test_unknown_attribute_still_fails():
    out = run("import mt_dualpipe as md\ntry:\n    md.nope\nexcept AttributeError as e:\n    print(e)")
    assert out.stdout.strip() == "module 'mt_dualpipe' has no attribute 'nope'"


def test_subpackages_name_every_package_folder():
    import mt_dualpipe

    folders = sorted(p.name for p in (ROOT / "mt_dualpipe").iterdir() if (p / "__init__.py").is_file())
    assert sorted(mt_dualpipe.SUBPACKAGES) == folders
