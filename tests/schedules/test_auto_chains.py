"""The annealing chain that runs in a child process (``auto.chains``) and the hand chain of large problems."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from mt_dualpipe.schedules import Costs, ScheduleError, build_schedule, simulate
from mt_dualpipe.schedules.auto import ANNEAL_MOVES, Layout
from mt_dualpipe.schedules.auto import search as search_mod
from mt_dualpipe.schedules.auto.chains import Chain, ChainJob

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
    ranks, makespan = chain.result()
    here_ranks, here_makespan = job.run()
    assert (ranks, makespan) == (here_ranks, here_makespan)
    dualpipe = simulate(build_schedule("dualpipe", 4, 8), EXPOSED).makespan
    assert makespan < dualpipe  # the chain did something: 34 against DualPipe's 37 on this profile


@pytest.mark.parametrize("executable", ["/bin/false", "/nonexistent/python"])
def test_a_child_that_fails_or_cannot_start_leaves_the_job_to_this_process(monkeypatch, executable):
    job = _job(steps=1500, seed=3)
    monkeypatch.setattr(sys, "executable", executable)
    starts = executable == "/bin/false"  # a missing interpreter: no child at all
    with pytest.warns(RuntimeWarning) as caught:
        chain = Chain(job, in_child=True)
        assert chain.in_child is starts
        got = chain.result()
    assert got == job.run()
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


def test_large_problem_result_does_not_depend_on_workers(monkeypatch):
    # a large problem (V, P=4, M=26: 624 ops > SMALL_PROBLEM_OPS) with short chains, so that the test stays quick
    monkeypatch.setattr(search_mod, "ANNEAL_MAX_STEPS", 2000)
    monkeypatch.setattr(search_mod, "ANNEAL_HAND_WORK", 10**9)
    P, M, costs = 4, 26, Costs(1, 1, 1, a2a_f=0.5, a2a_b=0.5)
    limit = max(simulate(build_schedule("dualpipev", P, M), costs).peak_activations)
    opts = dict(costs=costs, placement="v", memory_limit=limit, seed=5)
    here = build_schedule("auto", P, M, workers=1, **opts)
    child = build_schedule("auto", P, M, workers=2, **opts)
    assert here.ranks == child.ranks
    assert here.meta["makespan"] == child.meta["makespan"]
    assert here.meta["hand_chain"]["in_child"] is False and child.meta["hand_chain"]["in_child"] is True
    hand = here.meta["hand_chain"]
    assert hand["start"] == "dualpipev"
    assert hand["makespan"] < here.meta["baselines"]["dualpipev"]["makespan"]
    assert here.meta["makespan"] <= hand["makespan"]  # the hand chain's order was a candidate


def test_hand_chain_is_stopped_once_the_search_reaches_the_bound(monkeypatch):
    monkeypatch.setattr(search_mod, "ANNEAL_MAX_STEPS", 20_000)
    P, M = 4, 26  # dual with all-to-all = F: DualPipe 91, the search reaches the bound 88
    limit = max(simulate(build_schedule("dualpipe", P, M), EXPOSED).peak_activations)
    sched = build_schedule("auto", P, M, costs=EXPOSED, placement="dual", memory_limit=limit, workers=2)
    assert sched.meta["optimal"] is True and sched.meta["makespan"] == sched.meta["lower_bound"] == 88.0
    assert sched.meta["baselines"]["dualpipe"]["makespan"] == 91.0
    assert sched.meta["hand_chain"] == {"start": "dualpipe", "makespan": None, "in_child": True}


def test_small_problems_and_given_iterations_have_no_hand_chain():
    small = build_schedule("auto", 4, 8, costs=EXPOSED, placement="dual")
    assert small.meta["hand_chain"] is None
    bounded = build_schedule("auto", 4, 26, costs=EXPOSED, placement="dual", iterations=2)
    assert bounded.meta["hand_chain"] is None


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, "2"])
def test_bad_workers(workers):
    with pytest.raises(ScheduleError) as err:
        build_schedule("auto", 4, 8, workers=workers)
    message = f"workers must be a positive integer (processes the search may use) or None, got {workers!r}"
    assert message in str(err.value)
