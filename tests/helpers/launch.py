"""Launch ranks that may be killed: ``launch(fn, world, *args)`` returns each rank's exit code.

Unlike ``run_ranks`` (which wants every rank to return a value), this is for tests where a rank is
meant to die (``os._exit``, a kill injected by ``FaultInjector``): it waits with a deadline, kills
what is left and reports exit codes, so the test can check who died and relaunch.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

from mt_dualpipe.parallel.local_ranks import free_port
from tests.helpers.dist import pack_job, rank_context, unpack_job


def launch_child(rank: int, world: int, port: int, job: bytes) -> None:
    import torch.distributed as dist

    fn, args = unpack_job(job)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    fn(rank, world, *args)
    os._exit(0)  # skip teardown of groups a dead peer left broken


def launch(fn, world: int, *args, timeout: float = 90.0) -> list[int | None]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; returns the exit codes (killed ranks included)."""
    ctx = rank_context()
    port = free_port()
    job = pack_job(fn, args)  # by value, as in run_ranks
    procs = [ctx.Process(target=launch_child, args=(r, world, port, job), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if None in codes:
        raise TimeoutError(f"ranks hung: exit codes {codes}")
    return codes
