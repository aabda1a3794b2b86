"""Compare what a virtual environment holds (``pip freeze`` on stdin) with the pinned test tool chain.

    pip freeze --exclude-editable | python scripts/compare_pins.py requirements/test-constraints.txt --exact
    pip freeze --exclude-editable | python scripts/compare_pins.py requirements/test-constraints.txt --write

``--exact`` (CI) fails unless every installed distribution is pinned, at the installed version: a test
dependency that the constraints file misses would otherwise float to whatever a fresh machine resolves.
Without it, prints the packages whose installed version differs from the pin (the drift check's report);
``--write`` rewrites the file's pins to the installed versions, keeping its header.
A local version label (``2.13.0+cpu``) matches its public version (``2.13.0``), as pip's ``==`` does.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path


def normalise(name: str) -> str:
    """PEP 503's comparison form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


Pins = dict[str, tuple[str, str]]  # normalised name -> (name as written, version without a local label)


def parse_pins(lines: list[str]) -> Pins:
    """``name==version`` lines (comments, blanks and editable/URL lines skipped) -> {normalised: (name, version)}."""
    pins: dict[str, tuple[str, str]] = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-") or " @ " in line:
            continue
        if "==" not in line:
            raise SystemExit(f"not an exact pin (NAME==VERSION): {line!r}")
        name, version = (part.strip() for part in line.split("==", 1))
        pins[normalise(name)] = (name, version.split("+", 1)[0])
    return pins


def differences(pinned: Pins, installed: Pins) -> list[tuple[str, str, str]]:
    """(name, pinned version or '-', installed version or '-') for every package where the two differ."""
    rows = []
    for key in sorted(set(pinned) | set(installed)):
        want = pinned.get(key, (None, "-"))[1]
        have = installed.get(key, (None, "-"))[1]
        if want != have:
            rows.append(((installed.get(key) or pinned[key])[0], want, have))
    return rows


def write(path: Path, installed: Pins) -> None:
    today = datetime.date.today().isoformat()
    header = [re.sub(r"resolved on \d{4}-\d{2}-\d{2}", f"resolved on {today}", line)
              for line in path.read_text().splitlines() if line.startswith("#")]
    body = [f"{name}=={version}" for name, version in sorted(installed.values(), key=lambda nv: normalise(nv[0]))]
    path.write_text("\n".join(header + body) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("constraints", type=Path)
    ap.add_argument("--exact", action="store_true", help="fail unless the environment equals the pins")
    ap.add_argument("--write", action="store_true", help="rewrite the pins to the installed versions")
    args = ap.parse_args(argv)
    pinned = parse_pins(args.constraints.read_text().splitlines())
    installed = parse_pins(sys.stdin.read().splitlines())
    rows = differences(pinned, installed)
    if args.write:
        write(args.constraints, installed)
        print(f"{args.constraints}: {len(installed)} pins written ({len(rows)} changed)")
        return 0
    if not rows:
        print(f"the environment holds exactly the {len(pinned)} pinned versions of {args.constraints.name}")
        return 0
    width = max(len(name) for name, _, _ in rows)
    print(f"{'package':<{width}}  {'pinned':<14} installed")
    for name, want, have in rows:
        print(f"{name:<{width}}  {want:<14} {have}")
    if args.exact:
        print(f"the environment differs from {args.constraints} in {len(rows)} package(s): every test dependency "
              "must be pinned there (see its header)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
