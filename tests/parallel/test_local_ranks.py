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


START_FIRST = """
import multiprocessing.forkserver, os, sys
sys.path.insert(0, {root!r})
if __name__ == "__main__":
    from mt_dualpipe.parallel.local_ranks import start_rank_server
    start_rank_server(("json",))
    print("torch loaded:", "torch" in sys.modules, "server:", multiprocessing.forkserver._forkserver._forkserver_pid
          is not None, flush=True)

import torch  # noqa: E402
from mt_dualpipe.parallel.local_ranks import spawn_local_ranks  # noqa: E402


def rank_fn(rank):
    print("rank", rank, "torch in the server:", "torch" in sys.modules, flush=True)


if __name__ == "__main__" and "RANK" not in os.environ:  # under torchrun the process is the rank
    spawn_local_ranks(rank_fn, 2)
"""


@pytest.mark.parametrize("torchrun", [False, True])
def test_a_script_starts_the_server_before_it_imports_torch(tmp_path, torchrun):
    """``start_rank_server`` at a script's top starts the fork server without importing torch (the server's
    imports run beside the script's); the ranks then fork from it, the script (``__mp_main__``) and torch
    already imported there. Under torchrun (RANK and WORLD_SIZE set) the process is a rank: no server."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(START_FIRST.format(root=str(Path(__file__).resolve().parents[2])))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if torchrun:
        env.update(RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"torch loaded: False server: {not torchrun}"
    ranks = [] if torchrun else ["rank 0 torch in the server: True", "rank 1 torch in the server: True"]
    assert sorted(lines[1:]) == ranks
