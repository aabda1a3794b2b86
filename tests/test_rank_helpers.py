"""The multi-process test helpers: ranks see the test's environment and start fresh every time."""

from __future__ import annotations

import os

import torch

from tests.helpers.dist import run_ranks
from tests.helpers.launch import launch


def _report(rank: int, world: int, tensor: torch.Tensor) -> tuple[str | None, int, float, bool]:
    # the default dtype is process state a test may change; a fresh rank has the stock one
    fresh = torch.get_default_dtype() == torch.float32
    torch.set_default_dtype(torch.float64)
    return os.environ.get("MT_DUALPIPE_HELPER_PROBE"), torch.get_num_threads(), float(tensor.sum()), fresh


def test_ranks_see_the_environment_of_the_test_and_start_fresh(monkeypatch):
    run_ranks(_report, 2, torch.ones(3))  # the fork server is up before the variable is set
    monkeypatch.setenv("MT_DUALPIPE_HELPER_PROBE", "set-by-the-test")
    big = torch.arange(300_000, dtype=torch.float32)  # by value: no shared-memory handle per tensor
    first = run_ranks(_report, 2, big)
    second = run_ranks(_report, 2, big)
    assert first == second == [("set-by-the-test", 1, float(big.sum()), True)] * 2


def _exit_with_env(rank: int, world: int) -> None:
    # both ranks past the group's set-up first: rank 0 serves the rendezvous store, and leaving while
    # rank 1 still connects would kill rank 1 (exit 1) instead of letting it report its own code
    torch.distributed.barrier()
    os._exit(7 if os.environ.get("MT_DUALPIPE_HELPER_PROBE") == "launch" else 3)


def test_launch_passes_the_environment_and_reports_exit_codes(monkeypatch):
    monkeypatch.setenv("MT_DUALPIPE_HELPER_PROBE", "launch")
    assert launch(_exit_with_env, 2, timeout=60) == [7, 7]
