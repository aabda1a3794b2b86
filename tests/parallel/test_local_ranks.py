"""``spawn_local_ranks``: a development run's ranks, forked from a server that imported torch once."""

from __future__ import annotations

import multiprocessing.forkserver
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from mt_dualpipe.parallel.local_ranks import (
    DEFAULT_PRELOAD,
    free_port,
    local_context,
    spawn_local_ranks,
    start_method,
)


def _all_reduce_rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(f"{t.item()} {os.getpid()}")


def _fails_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_ranks_run_and_communicate(tmp_path):
    spawn_local_ranks(_all_reduce_rank, 3, (3, free_port(), str(tmp_path)))
    got = [(tmp_path / f"rank{r}").read_text().split() for r in range(3)]
    assert [float(total) for total, _ in got] == [6.0] * 3
    assert len({pid for _, pid in got} | {str(os.getpid())}) == 4  # three processes of their own


def test_an_exception_on_a_rank_is_raised_here_with_its_message():
    with pytest.raises(ProcessRaisedException, match="rank one refuses"):
        spawn_local_ranks(_fails_on_rank_one, 2)


def test_forkserver_where_the_platform_has_one_with_the_preload_and_main():
    assert start_method() == "forkserver"  # Linux and macOS; spawn elsewhere
    ctx = local_context(("json",))
    assert ctx.get_start_method() == "forkserver"
    assert multiprocessing.forkserver._forkserver._preload_modules == ["__main__", "json"]  # what a new server imports
    assert "torch" in DEFAULT_PRELOAD and "torch._dynamo" in DEFAULT_PRELOAD


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        spawn_local_ranks(_fails_on_rank_one, 0)
