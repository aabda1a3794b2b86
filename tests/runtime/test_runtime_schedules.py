"""Every registered schedule, P in {2, 4}, several M: one training step on gloo ranks equals the
single-process reference (losses bit-equal, gradients within 1e-12 cosine difference in fp64),
the recorded peak activations equal the simulator's, and an inference step under no_grad returns
the reference outputs and losses without touching gradients.

All cases of one P run inside one spawn of P processes (spawning is the expensive part here)."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.schedules import build_schedule, list_schedules, simulate
from mt_dualpipe.schedules.registry import accepts
from tests.helpers.dist import run_ranks
from tests.helpers.models import check_against_reference, make_data, make_layers, pipeline_worker


def _cases(P: int) -> list[tuple[str, int]]:
    out = []
    for info in list_schedules():
        ok = [M for M in range(1, 4 * P + 2) if accepts(info.name, P, M) is None]
        assert ok, f"{info.name} accepts no M <= {4 * P + 1} for P={P}"
        picks = sorted({ok[0], ok[len(ok) // 2], ok[-1]})  # the smallest, a middle and a large M
        out += [(info.name, M) for M in picks]
    return out


def _all_cases_worker(rank, world, cases):
    torch.set_num_threads(1)
    return [pipeline_worker(rank, world, sched, layers, x, lab, infer=True) for sched, layers, x, lab in cases]


_RESULTS: dict[int, tuple] = {}


def _results(P: int):
    if P not in _RESULTS:
        cases = []
        for name, M in _cases(P):
            sched = build_schedule(name, P, M)
            cases.append((sched, make_layers(len(sched.placement[0]), seed=M), *make_data(M, seed=M + 1)))
        per_rank = run_ranks(_all_cases_worker, P, cases, timeout=240)
        _RESULTS[P] = (cases, [[per_rank[r][i] for r in range(P)] for i in range(len(cases))])
    return _RESULTS[P]


# P=4 is slow: P=2 runs every schedule; DualPipe/DualPipeV at 4 ranks run in test_runtime_dualpipe.py by default
@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_schedule_matches_reference(P):
    cases, results = _results(P)
    names = {sched.name for sched, *_ in cases}
    assert names == {info.name for info in list_schedules()}
    for (sched, layers, x, lab), res in zip(cases, results):
        check_against_reference(sched, res, layers, x, lab)


@pytest.mark.parametrize("P", [2, 4])
def test_peak_activations_equal_simulation(P):
    cases, results = _results(P)
    for (sched, *_), res in zip(cases, results):
        assert [r["peak"] for r in res] == simulate(sched).peak_activations, sched.name


@pytest.mark.parametrize("P", [2, 4])
def test_inference_step_matches_reference_and_keeps_grads(P):
    from tests.helpers.models import reference

    cases, results = _results(P)
    for (sched, layers, x, lab), res in zip(cases, results):
        ref_loss, ref_outs, _ = reference(layers, x, lab, sched.num_microbatches)
        for r in res:
            iloss, iouts = r["infer"]
            if not r["chain_end"]:
                assert iloss is None and iouts is None
                continue
            mbs = sched.microbatches_of(r["chain_end"][0])
            assert torch.equal(iloss, ref_loss[mbs]), sched.name
            assert torch.equal(iouts, torch.cat([ref_outs[i] for i in mbs])), sched.name
            for before, after in zip(r["grads"], r["grads_after_infer"]):
                assert all(torch.equal(a, b) for a, b in zip(before, after)), sched.name
