#!/usr/bin/env bash
# Drift check, for maintainers: run the tests with the NEWEST releases of the test tool chain, so that the
# next breaking release (of pytest, hypothesis, transformers, ...) is found on purpose, not by a new user.
#
#   scripts/check_latest_deps.sh            # newest tool chain: lint + the pure-Python part of the suite
#   scripts/check_latest_deps.sh --all      # ... and the whole default tier
#   scripts/check_latest_deps.sh --write    # then, if all passed, pin what it resolved
#
# It builds a throw-away virtual environment, installs torch==2.13.0 (the CPU build; the library's torch
# range is not what this checks) and then ".[test,dev]" with no constraints, prints each package whose
# newest release differs from requirements/test-constraints.txt, and runs ruff, mypy and the tests there.
# To bump the pins: run it with --write (it writes only after every step passed), then run .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINTS=requirements/test-constraints.txt
# The pure-Python part: the schedule compiler, its diagrams and CLI, the package checks (one test starts ranks).
PURE=(tests/schedules tests/visualize tests/cli tests/test_package.py tests/test_no_private_imports.py)

all=0 write=0
for arg in "$@"; do
  case "$arg" in
    --all) all=1 ;;
    --write) write=1 ;;
    *) echo "usage: $0 [--all] [--write]" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
# torch stays at the CPU build: an eager upgrade would take a newer, multi-GB CUDA build
echo "torch==2.13.0" > "$work/torch.txt"
"$py" -m pip install -q -c "$work/torch.txt" "torch==2.13.0"
"$py" -m pip install -q -c "$work/torch.txt" --upgrade --upgrade-strategy eager -e ".[test,dev]"
echo "newest releases against $CONSTRAINTS:"
"$py" -m pip freeze --exclude-editable | "$py" scripts/compare_pins.py "$CONSTRAINTS"

"$py" -m ruff check .
"$py" -m mypy  # a newer mypy may read the typed contracts more strictly
if [[ $all == 1 ]]; then
  "$py" -m pytest -q tests
else
  "$py" -m pytest -q "${PURE[@]}"
fi
if [[ $write == 1 ]]; then
  "$py" -m pip freeze --exclude-editable | "$py" scripts/compare_pins.py "$CONSTRAINTS" --write
fi
