"""The annealing chain that runs in a child process (``auto.chains``) and the hand chain of large problems."""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, simulate
from mt_dualpipe.schedules.auto import ANNEAL_MOVES, Layout
from mt_dualpipe.schedules.auto import search as search_mod
from mt_dualpipe.schedules.auto.chains import Chain, ChainJob, default_workers, run_job_folder

EXPOSED = Costs(1, 1, 1, a2a_f=1.0, a2a_b=1.0)


def _job(steps: int = 3000, seed: int = 7) -> ChainJob:
    """A chain on the dual placement at P=4, M=8 with exposed all-to-all, from DualPipe."""
    layout = Layout.named("dual", 4, 8)
    start = build_schedule("dualpipe", 4, 8)
    limit = max(simulate(start, EXPOSED).peak_activations)
    return ChainJob(layout, EXPOSED, [limit] * 4, [list(x) for x in start.ranks], seed, steps, None, 0.006,
                    ANNEAL_MOVES, float("-inf"))


def test_chain_in_a_child_gives_the_order_of_the_same_job_run_here():
    job = _job()
    chain = Chain(job, in_child=True)
    assert chain.in_child
    ranks, makespan, repaired = chain.result()
    assert repaired == []  # a job without ``repair``
    here_ranks, here_makespan = job.run()
    assert (ranks, makespan) == (here_ranks, here_makespan)
    dualpipe = simulate(build_schedule("dualpipe", 4, 8), EXPOSED).makespan
    assert makespan < dualpipe  # the chain did something: 34 against DualPipe's 37 on this profile


@pytest.mark.parametrize("breakage", ["child fails", "no interpreter", "no temporary folder"])
def test_a_child_that_fails_or_cannot_start_leaves_the_job_to_this_process(monkeypatch, breakage):
    job = _job(steps=1500, seed=3)
    if breakage == "no temporary folder":
        monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tmp")
    else:
        monkeypatch.setattr(sys, "executable", "/bin/false" if breakage == "child fails" else "/nonexistent/python")
    starts = breakage == "child fails"
    with pytest.warns(RuntimeWarning) as caught:
        chain = Chain(job, in_child=True)
        assert chain.in_child is starts
        got = chain.result()
    assert got == job.outcome()
    (warning,) = caught
    expected = ("the child process of an annealing chain failed (exit code 1)" if starts
                else "could not start a child process for an annealing chain")
    assert expected in str(warning.message)
    assert "runs in this process" in str(warning.message)


def test_cancel_stops_a_running_child_and_removes_its_files():
    chain = Chain(_job(steps=10_000_000), in_child=True)
    folder = Path(chain.folder.name)
    assert (folder / "job.pkl").exists()
    time.sleep(0.3)
    assert chain.proc.poll() is None  # still annealing
    chain.cancel()
    assert chain.proc.poll() is not None
    assert not folder.exists()


def test_an_orphaned_child_removes_its_folder(tmp_path):
    folder = tmp_path / "chain"
    folder.mkdir()
    (folder / "job.pkl").write_bytes(pickle.dumps(_job(steps=200)))
    run_job_folder(str(folder), parent=os.getppid())  # the parent that started it is still there
    assert pickle.loads((folder / "result.pkl").read_bytes()) == _job(steps=200).outcome()
    run_job_folder(str(folder), parent=-1)  # started by a process that is gone
    assert not folder.exists()


def _large_v(monkeypatch) -> tuple[int, int, dict]:
    """A problem made large (V, P=4, M=16: 384 ops, over a SMALL_PROBLEM_OPS lowered to 350) with short chains, so
    that tests stay quick; the search stops short of the bound there (110.5 against 110.1), so hand chains run."""
    monkeypatch.setattr(search_mod, "ANNEAL_MAX_STEPS", 2000)
    monkeypatch.setattr(search_mod, "ANNEAL_HAND_WORK", 10**9)
    monkeypatch.setattr(search_mod, "SMALL_PROBLEM_OPS", 350)
    P, M, costs = 4, 16, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5, comm=0.2)
    limit = max(simulate(build_schedule("dualpipev", P, M), costs).peak_activations)
    return P, M, dict(costs=costs, placement="v", memory_limit=limit, seed=5)


@pytest.mark.slow  # the three-chain test below checks the same on workers 1, 2 and 4
def test_large_problem_result_does_not_depend_on_workers(monkeypatch):
    P, M, opts = _large_v(monkeypatch)
    here = build_schedule("auto", P, M, workers=1, **opts)
    child = build_schedule("auto", P, M, workers=2, **opts)
    assert here.ranks == child.ranks
    assert here.meta["makespan"] == child.meta["makespan"]
    (hand,), (hand_child,) = here.meta["hand_chains"], child.meta["hand_chains"]
    assert hand["in_child"] is False and hand_child["in_child"] is True
    assert hand["makespan"] == hand_child["makespan"]
    assert hand["start"] == "dualpipev+sink"  # the hand schedule, backwards split and W's late (``polish_hand``)
    assert hand["makespan"] < here.meta["baselines"]["dualpipev"]["makespan"]
    assert here.meta["makespan"] <= hand["makespan"]  # the hand chain's order was a candidate


def test_more_chains_run_side_by_side_and_give_the_same_result_on_any_workers(monkeypatch):
    P, M, opts = _large_v(monkeypatch)
    one = build_schedule("auto", P, M, chains=1, workers=1, **opts)
    runs = {w: build_schedule("auto", P, M, chains=3, workers=w, **opts) for w in (1, 2, 4)}
    first = runs[1]
    for w, run in runs.items():
        assert run.ranks == first.ranks, w
        assert [h["makespan"] for h in run.meta["hand_chains"]] == [h["makespan"] for h in first.meta["hand_chains"]]
    # workers=2: one child beside the search, then two at a time once it waits; workers=4: all three beside it
    assert [h["in_child"] for h in runs[1].meta["hand_chains"]] == [False] * 3
    assert [h["in_child"] for h in runs[2].meta["hand_chains"]] == [True] * 3
    chains = first.meta["hand_chains"]
    assert chains[0] == one.meta["hand_chains"][0]  # chain k's seed does not depend on how many chains run
    assert [h["start"] for h in chains] == ["dualpipev+sink"] * 3
    assert chains[0]["makespan"] < first.meta["baselines"]["dualpipev"]["makespan"]
    assert first.meta["makespan"] <= min(h["makespan"] for h in chains) <= one.meta["hand_chains"][0]["makespan"]


def test_hand_chain_is_stopped_once_the_search_reaches_the_bound(monkeypatch):
    monkeypatch.setattr(search_mod, "ANNEAL_MAX_STEPS", 20_000)
    P, M = 4, 26  # dual with all-to-all = F: DualPipe 91, the search reaches the bound 88
    limit = max(simulate(build_schedule("dualpipe", P, M), EXPOSED).peak_activations)
    sched = build_schedule("auto", P, M, costs=EXPOSED, placement="dual", memory_limit=limit, workers=2)
    assert sched.meta["optimal"] is True and sched.meta["makespan"] == sched.meta["lower_bound"] == 88.0
    assert sched.meta["baselines"]["dualpipe"]["makespan"] == 91.0
    assert sched.meta["hand_chains"] == [{"start": "dualpipe+sink", "makespan": None, "in_child": True}]


def test_default_workers_follow_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert [default_workers(k) for k in (0, 1, 2, 5)] == [1, 2, 3, 3]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_workers(3) == 1


def test_small_problems_given_iterations_and_no_chains_have_no_hand_chain(monkeypatch):
    small = build_schedule("auto", 4, 8, costs=EXPOSED, placement="dual")
    assert small.meta["hand_chains"] == []
    bounded = build_schedule("auto", 4, 26, costs=EXPOSED, placement="dual", iterations=2)
    assert bounded.meta["hand_chains"] == []
    P, M, opts = _large_v(monkeypatch)
    assert build_schedule("auto", P, M, chains=0, **opts).meta["hand_chains"] == []


@pytest.mark.parametrize("kwargs,message", [
    *[(dict(workers=w), f"workers must be a positive integer (processes the search may use) or None, got {w!r}")
      for w in (0, -1, True, 1.5, "2")],
    *[(dict(chains=c), f"chains must be a non-negative integer (annealing chains from the best hand schedule), "
       f"got {c!r}") for c in (-1, None, False, 2.0)],
])
def test_bad_chains_and_workers(kwargs, message):
    with pytest.raises(ScheduleError) as err:
        build_schedule("auto", 4, 8, **kwargs)
    assert message in str(err.value)
