"""Suite-wide settings: how many pytest-xdist workers ``-n auto`` (the default, see pyproject.toml) starts, and
bytecode caches written even where the environment turned them off."""

from __future__ import annotations

import os
import sys

# Multi-process tests start 2-8 gloo ranks of their own, so more workers than this only adds contention
# (and a torch import, ~0.5 GB, per worker); two workers keep two cores busy where one alone left them
# half idle while ranks waited on each other.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))


def _write_bytecode_caches() -> None:
    """With PYTHONDONTWRITEBYTECODE set, every process of the run (two workers, the example and CLI subprocesses,
    annealing children) would compile the package and rewrite the test modules' asserts from source again:
    about 5 s per worker and 1-2 s per subprocess on two cores. The run writes the usual ``__pycache__``
    folders instead (git ignores them). Set here, before any test module is imported and before xdist starts
    its workers, which inherit the environment."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


_write_bytecode_caches()
