"""The ``mt-dualpipe`` command: a thin argparse front over the library's layers.

Each subcommand lives in its own module with a ``register(subparsers)`` function that adds its
parser and sets ``func``; this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..schedules.errors import ScheduleError

_COMMAND_MODULES = ("schedule_cmds", "render_cmd", "plan_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mt-dualpipe", description="DualPipe and Zero-Bubble pipeline schedules")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ScheduleError as exc:
        print(f"mt-dualpipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
