"""Suite-wide settings: how many pytest-xdist workers ``-n auto`` (the default, see pyproject.toml) starts."""

from __future__ import annotations

import os

# Multi-process tests start 2-8 gloo ranks of their own, so more workers than this only adds contention
# (and a torch import, ~0.5 GB, per worker); two workers keep two cores busy where one alone left them
# half idle while ranks waited on each other.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores))
