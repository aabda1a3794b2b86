"""Placeholder: this subcommand is being written (register adds nothing yet)."""


def register(subparsers) -> None:  # noqa: ARG001
    return None
