"""The pinned test tool chain: requirements/test-constraints.txt pins every test and lint dependency exactly,
and scripts/compare_pins.py (which .ci/run uses to refuse an environment that holds anything unpinned) says so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "requirements" / "test-constraints.txt"
SCRIPT = ROOT / "scripts" / "compare_pins.py"


def compare(freeze: str, *flags: str, constraints: Path = CONSTRAINTS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(constraints), *flags], input=freeze, text=True,
                          capture_output=True, timeout=60)


def pinned() -> dict[str, str]:
    lines = [line for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][^\s]*", line) for line in lines), "only exact NAME==VERSION pins"
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in (line.split("==") for line in lines)}


def test_every_test_and_dev_extra_and_torch_is_pinned():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {*project["optional-dependencies"]["test"], *project["optional-dependencies"]["dev"],
              *project["dependencies"]}
    names = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]).lower() for req in wanted}
    pins = pinned()
    assert names - set(pins) == set()
    assert pins["torch"] == "2.13.0"  # the CPU build on local disk, as .ci/run and the README install it


def test_exact_accepts_the_pins_with_a_local_label_and_refuses_drift_or_an_unpinned_package():
    pins = pinned()
    freeze = "\n".join(f"{name}=={version}+cpu" if name == "torch" else f"{name}=={version}"
                       for name, version in pins.items())
    ok = compare(freeze, "--exact")
    assert ok.returncode == 0 and f"exactly the {len(pins)} pinned versions" in ok.stdout
    drift = freeze.replace(f"pytest=={pins['pytest']}", "pytest==9.9.9") + "\nleftover-pkg==1.0"
    bad = compare(drift, "--exact")
    assert bad.returncode == 1
    rows = [line.split() for line in bad.stdout.splitlines()[1:]]
    assert rows == [["leftover-pkg", "-", "1.0"], ["pytest", pins["pytest"], "9.9.9"]]
    assert "differs from" in bad.stderr and "in 2 package(s)" in bad.stderr


def test_write_rewrites_the_pins_and_keeps_the_header(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# header, resolved on 2000-01-01\nb-pkg==1\nA_Pkg==2\n")
    done = compare("A-Pkg==3\nc.pkg==4+local\n", "--write", constraints=path)
    assert done.returncode == 0 and "2 pins written (3 changed)" in done.stdout
    header, *body = path.read_text().splitlines()
    assert re.fullmatch(r"# header, resolved on \d{4}-\d{2}-\d{2}", header) and "2000" not in header
    assert body == ["A-Pkg==3", "c.pkg==4"]


def test_a_range_in_the_constraints_is_refused(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("pytest>=9\n")
    done = compare("", constraints=path)
    assert done.returncode != 0 and "not an exact pin (NAME==VERSION): 'pytest>=9'" in done.stderr
