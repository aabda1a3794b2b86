"""Annealing chains that run in child processes while the search's phases run in this one.

On large problems (``search.anneal_plan``) ``auto`` anneals from the best order of its phases and,
``chains`` times (default once), from the best hand schedule. Those chains need nothing the phases
find, so they start at once in child processes and share the wall time of the search. Measured at
P=8, M=24 with exposed all-to-all 1.0 of F (benchmarks/results/auto_schedule.md, "History"): from
DualPipeV a chain ends at 193.9 on average over 32 seeds (best known 191), from the phases' best at
195.1 over eight: the phases' order sits in a deeper basin that annealing leaves less often; with
0.5 of F the phases' start wins. So both run and the better wins; ``Chains`` runs several such
chains on as many processes.

Why a child Python of its own (running ``run_job_folder``) rather than
``multiprocessing``: *spawn* and *forkserver* re-import the caller's ``__main__``, which recurses
in a script without a main guard, and *fork* copies a process that may hold torch's threads. The
job and the result travel through files in a temporary folder, so no pipe can fill up.

The result does not depend on where the chain ran: a ``ChainJob`` is seeded and bounded by steps
and walked ops, not the clock (unless it has a time budget). Without a second process (``workers=1``,
a one-core machine, or a child that failed to start or finish) the chain runs here when its result
is asked for, and gives the same order.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..costs import Costs
from ..ir import ComputeItem
from .layout import Layout
from .local import Move, anneal
from .repair import anneal_repaired, repairs

Ranks = list[list[ComputeItem]]
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder that holds ``mt_dualpipe``
_CHILD = f"import sys; from {__name__} import run_job_folder; run_job_folder(sys.argv[1], int(sys.argv[2]))"


@dataclass(frozen=True)
class ChainJob:
    """Everything one seeded annealing chain needs (``local.anneal``'s arguments), picklable."""

    layout: Layout
    costs: Costs
    limits: list[int]
    ranks: Ranks
    seed: int
    steps: int
    work: int | None
    heat: float
    moves: tuple[tuple[str, float, Move], ...]
    floor: float
    ends_at: float | None = None  # the caller's deadline on the wall clock (``time.time()``), if it has one
    cold_reach: int = 1  # ``anneal``'s: how much farther moves reach once the chain is cold
    repair: bool = False  # also repair the chain's best order (``repair.repairs``) where it runs
    pairing: bool = False  # ``repair.repairs``' ``pairing``: FB units pay on this problem

    def _deadline(self) -> float | None:
        return None if self.ends_at is None else time.perf_counter() + (self.ends_at - time.time())

    def run(self) -> tuple[Ranks, float]:
        """The chain's best order and its makespan (``repair``: repaired on the way, ``repair.anneal_repaired``)."""
        if self.repair:
            return anneal_repaired(self.layout, self.costs, self.limits, self.ranks, random.Random(self.seed),
                                   self.steps, self._deadline(), self.moves, self.heat, self.work, self.floor,
                                   self.cold_reach, self.pairing)
        return anneal(self.layout, self.costs, self.limits, self.ranks, random.Random(self.seed), self.steps,
                      self._deadline(), self.moves, heat=self.heat, work=self.work, floor=self.floor,
                      cold_reach=self.cold_reach)

    def outcome(self) -> tuple[Ranks, float, list[tuple[Ranks, str]]]:
        """``run``'s order and makespan, and with ``repair`` the repaired orders the search is to consider
        after it (``repair.repairs``): work that needs nothing of the search, so it runs in the child too."""
        ranks, makespan = self.run()
        if not self.repair:
            return ranks, makespan, []
        return ranks, makespan, repairs(self.layout, self.costs, self.limits, ranks, self.floor, self.pairing,
                                        self._deadline())


def default_workers(chains: int) -> int:
    """Processes the search may use by default: one per chain and one for the search, at most the cores this
    process may run on (its CPU affinity where the platform has one, e.g. under ``taskset`` or a job scheduler)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, chains + 1))


class Chain:
    """A ``ChainJob`` started in a child process (``in_child``), or kept to run here when asked."""

    def __init__(self, job: ChainJob, in_child: bool) -> None:
        self.job = job
        self.proc: subprocess.Popen | None = None
        self.folder: tempfile.TemporaryDirectory | None = None
        if in_child:
            self._start()

    @property
    def in_child(self) -> bool:
        """True while the job runs (or ran) in a child process."""
        return self.proc is not None

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if x)
        folder = None
        try:
            if not sys.executable:
                raise OSError("sys.executable is empty: no interpreter to start")
            folder = tempfile.TemporaryDirectory(prefix="mt_dualpipe_chain_")
            path = Path(folder.name)
            (path / "job.pkl").write_bytes(pickle.dumps(self.job))
            with open(path / "stderr.txt", "wb") as err:
                self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(os.getpid())],
                                             stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=err, env=env)
        except OSError as exc:  # no process (or no temporary folder) to be had: the job runs here when asked
            if folder is not None:
                folder.cleanup()
            warnings.warn(f"auto: could not start a child process for an annealing chain ({exc}); it runs in this "
                          "process after the search instead (same result, more time; workers=1 says so quietly)",
                          RuntimeWarning, stacklevel=2)
            return
        self.folder = folder

    def result(self) -> tuple[Ranks, float, list[tuple[Ranks, str]]]:
        """The chain's ``ChainJob.outcome``: the child's, or this process's run of the same job."""
        if self.proc is not None:
            code = self.proc.wait()
            path = Path(self.folder.name)
            out = path / "result.pkl"
            got = pickle.loads(out.read_bytes()) if code == 0 and out.exists() else None
            if got is None:
                lines = (path / "stderr.txt").read_text(errors="replace").strip().splitlines()
                warnings.warn(f"auto: the child process of an annealing chain failed (exit code {code}"
                              f"{': ' + lines[-1] if lines else ''}); the chain runs in this process instead "
                              "(same result, more time)", RuntimeWarning, stacklevel=2)
            self.cancel()
            if got is not None:
                return got
        return self.job.outcome()  # not started, or the child failed: the same seeded chain, here

    def cancel(self) -> None:
        """Stop the child if it still runs and remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None


def run_job_folder(folder: str, parent: int | None = None) -> None:
    """The child's side: run ``folder``/job.pkl, write its result to ``folder``/result.pkl.

    If the ``parent`` process is gone by then (killed before it could read the result and clean
    up), the child removes the folder itself, so nothing is left behind in the temporary folder.
    """
    path = Path(folder)
    job: ChainJob = pickle.loads((path / "job.pkl").read_bytes())
    got = job.outcome()
    if parent is not None and os.getppid() != parent:
        shutil.rmtree(path, ignore_errors=True)
        return
    tmp = path / "result.tmp"
    tmp.write_bytes(pickle.dumps(got))
    tmp.replace(path / "result.pkl")  # whole or absent


class Chains:
    """Jobs run on up to ``workers`` processes, results read in job order.

    While the caller still works (the search's phases), ``workers - 1`` children run the first
    jobs; once it waits for results (``results``) it only waits, so up to ``workers`` children run
    and each finished one makes room for the next job. With ``workers=1`` every job runs here, in
    order, when its result is read. Either way job k gives the same result.
    """

    def __init__(self, jobs: list[ChainJob], workers: int) -> None:
        self.jobs = jobs
        self.workers = workers
        self.started: list[Chain] = []
        self._top_up(workers - 1)

    def _top_up(self, limit: int) -> None:
        running = sum(1 for c in self.started if c.proc is not None and c.proc.poll() is None)
        while len(self.started) < len(self.jobs) and running < limit:
            self.started.append(Chain(self.jobs[len(self.started)], in_child=True))
            running += 1

    def results(self, stop: Callable[[], bool]) -> Iterator[tuple[int, tuple[Ranks, float, list], bool]]:
        """(job index, its ``ChainJob.outcome``, whether it ran in a child), job by job until ``stop()`` says so."""
        for k, job in enumerate(self.jobs):
            if stop():
                return
            if self.workers > 1:
                self._top_up(self.workers)
            chain = self.started[k] if k < len(self.started) else Chain(job, in_child=False)
            yield k, chain.result(), chain.in_child

    def cancel(self) -> None:
        """Stop every child still running and remove the files of all."""
        for chain in self.started:
            chain.cancel()

