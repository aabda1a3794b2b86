"""Run a benchmark's worker on local gloo ranks and return rank 0's result (shared by the benchmark scripts).

``worker(rank, ranks, port, *args, queue)`` must put rank 0's result on ``queue``. A rank that exits
with an error fails the run at once (the others are killed) instead of leaving the parent waiting.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mt_dualpipe.parallel.local_ranks import free_port


def run_local(worker: Callable[..., None], ranks: int, args: tuple, timeout: float) -> Any:
    """Spawn ``ranks`` processes of ``worker`` and return what rank 0 put on the queue."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, *args, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = q.get(timeout=1)
            break
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"benchmark failed: rank(s) {dead} exited with an error" if dead
                                 else f"benchmark timed out after {timeout:g} s") from None
    for p in procs:
        p.join()
    return result
