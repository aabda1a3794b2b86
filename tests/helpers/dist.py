"""Run a function on N local gloo ranks (fresh processes) with a timeout.

``run_ranks(fn, world_size, *args, timeout=60)`` starts ``world_size`` fresh processes (see
``rank_context``), initialises a gloo process group on 127.0.0.1 with a free port, sets
``torch.set_num_threads(1)``, calls ``fn(rank, world_size, *args)`` in each and returns the list of
per-rank return values. A rank that raises makes ``run_ranks`` raise ``RankError`` carrying that
rank's traceback (the root cause first: a rank that failed on its own beats one that timed out
waiting for it or stopped because it failed), or, with ``return_exceptions=True``, puts a
``RankFailure`` in its slot. A run that takes longer than ``timeout`` seconds is killed and raises
``TimeoutError``, so a hang fails the test instead of blocking it. ``fn`` must be a module-level
function (it is pickled); ``fn``, its arguments and the return values travel by plain pickle
(tensors by value: no shared-memory handles, whose file descriptors a fork server could not pass
in numbers).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from mt_dualpipe.parallel.local_ranks import free_port

# What the fork server imports once, so that no rank pays for it again.
# torch._dynamo: the first torch.optim optimizer of a process imports it (about 2 s of CPU per rank otherwise).
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                "torch.distributed.checkpoint", "mt_dualpipe.runtime", "mt_dualpipe.parallel",
                "mt_dualpipe.models.deepseek_v3", "mt_dualpipe.models.llama", "mt_dualpipe.resilience"]


def rank_context() -> Any:
    """The multiprocessing context for test ranks: a fork server that has imported torch already.

    Each rank is still a fresh process, forked from a server that has only imported modules, so no
    state leaks from one test into the next; but it no longer imports torch itself, which on two
    slow cores was about 3.5 s of every multi-process test (spawn re-imports everything per rank).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


@dataclass
class RankFailure:
    rank: int
    type_name: str
    message: str
    traceback: str


class RankError(RuntimeError):
    def __init__(self, failure: RankFailure):
        super().__init__(f"rank {failure.rank} raised {failure.type_name}: {failure.message}\n{failure.traceback}")
        self.failure = failure


def pack_job(fn: Callable, args: tuple) -> bytes:
    """``fn``, its arguments and the caller's environment, by value (the fork server's own
    environment is the one it started with; a rank should see the test's, as a spawned one would)."""
    return pickle.dumps((fn, args, dict(os.environ)))


def unpack_job(job: bytes) -> tuple[Callable, tuple]:
    fn, args, env = pickle.loads(job)
    os.environ.clear()
    os.environ.update(env)
    return fn, args


def _child(rank: int, world_size: int, port: int, job: bytes, results: Any, pg_timeout: float) -> None:
    import torch.distributed as dist

    try:
        fn, args = unpack_job(job)
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))  # plain pickle: no shared-memory handles
    except BaseException as exc:  # report everything; the parent decides
        results.put((rank, False, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0,
              return_exceptions: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; per-rank return values."""
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    job = pack_job(fn, args)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, job, results, timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    failures: list[RankFailure] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s (hang?); finished: {sorted(got)}")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got and p.exitcode != 0]
                if dead and results.empty():
                    raise RuntimeError(f"rank(s) {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]} without reporting") from None
                continue
            got[rank] = pickle.loads(value) if ok else value
            if not ok and not return_exceptions:
                failures.append(value)
                deadline = min(deadline, time.monotonic() + 3.0)  # collect the peers' errors briefly
        if failures:
            failures.sort(key=lambda f: (f.type_name in ("PipelineTimeoutError", "PipelineCommError",
                                                          "PipelinePeerError"), f.rank))
            raise RankError(failures[0])
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [got[r] for r in range(world_size)]
