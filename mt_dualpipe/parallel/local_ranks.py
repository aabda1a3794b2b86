"""Start a development run's ranks on this machine, forked from a server that has imported torch once.

``torch.multiprocessing.spawn`` starts every rank as a new interpreter, which imports torch,
``torch.distributed`` and the caller's script again: about 2 s of CPU per rank on a small machine,
more than a short demo's whole training. ``spawn_local_ranks`` starts them from a *fork server*
instead (``multiprocessing``'s ``forkserver`` method): one clean process imports the modules named
in ``preload`` (and the caller's ``__main__``) once, and each rank is a fork of it, ready in
milliseconds. The server only imports, it never runs a kernel or touches a device, so its forks are
as safe as spawned processes for CUDA/MUSA ranks. Where the platform has no fork server (Windows) it
falls back to spawn.

A script can start the server first thing, before it imports torch itself (``start_rank_server``,
which imports no torch): the server's imports then run beside the script's own instead of after
them, and the ranks start about 2 s sooner on an idle 2-core machine (the DeepSeek-V3 demo's first
step: 5.7 s after launch before, 3.9 s after).

Two things a fork server implies, both as with ``multiprocessing`` itself: the server starts at the
first launch of the process (or at ``start_rank_server``) and keeps the environment and ``sys.path`` it
had then (set ``OMP_NUM_THREADS`` and friends before), and ``fn`` must be a module-level function (it is
pickled). Multi-node runs use ``torchrun``; this is for one machine.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

# What a rank of this library's examples imports anyway; each costs every spawned rank again. ``torch._dynamo``
# is imported by the first ``torch.optim`` optimizer a process builds (about 2 s of CPU on its own).
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor",
                   "torch.distributed.checkpoint", "mt_dualpipe", "mt_dualpipe.runtime", "mt_dualpipe.parallel.mesh")


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def local_context(preload: Sequence[str] = DEFAULT_PRELOAD) -> Any:
    """The ``multiprocessing`` context that ranks start from: a fork server that imports ``preload``
    and ``__main__`` once (it is set before the server starts; a server already running keeps its list)."""
    method = start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["__main__", *preload])
    return ctx


def start_rank_server(preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
    """Start the fork server now, in the background, so that its imports overlap the caller's: call it at
    the top of a script, before ``import torch``, under ``if __name__ == "__main__"`` (the server imports the
    script as ``__mp_main__``) and after any ``sys.path`` change the ranks need. Imports no torch here; a
    no-op under ``torchrun`` (the process is a rank itself) and where ranks are spawned (no fork server)."""
    if start_method() == "forkserver" and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        local_context(preload)
        multiprocessing.forkserver.ensure_running()


def spawn_local_ranks(fn: Callable[..., Any], nprocs: int, args: tuple = (), join: bool = True,
                      preload: Sequence[str] = DEFAULT_PRELOAD) -> Any:
    """Run ``fn(rank, *args)`` on ``nprocs`` local processes, like ``torch.multiprocessing.spawn``
    (same signature, same error reporting: a rank's exception is raised here with its traceback)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    import torch.multiprocessing as torch_mp  # here, not at the top: start_rank_server runs before torch loads

    local_context(preload)
    return torch_mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=start_method())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: the rendezvous port of a run's local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_init_method() -> str:
    """``init_method`` for ``dist.init_process_group`` of ranks started by ``spawn_local_ranks`` on this machine."""
    return f"tcp://127.0.0.1:{free_port()}"
