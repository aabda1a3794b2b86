"""``mt_dualpipe.profile``: measured per-stage costs of real stage modules, fed to the auto schedule."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mt_dualpipe.runtime.stage")

import torch.nn as nn  # noqa: E402

import mt_dualpipe  # noqa: E402
from mt_dualpipe.planner.profile import profile, profile_stages  # noqa: E402
from mt_dualpipe.schedules import Costs, build_schedule, simulate, validate  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402


def mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_lazy_top_level_export():
    assert mt_dualpipe.profile is profile


def test_saved_activation_bytes_are_exact():
    torch.manual_seed(0)
    mods = [mlp(64, 256) for _ in range(3)]
    prof = profile_stages(mods, (torch.randn(32, 64),), warmup=0, repeats=1)
    # each stage saves its input (32x64 fp32) for the first linear and the ReLU output (32x256), which the
    # second linear saves too (one storage); parameters are not activations
    assert prof.activation_bytes == [32 * 64 * 4 + 32 * 256 * 4] * 3
    assert prof.param_bytes == [(64 * 256 + 256 + 256 * 64 + 64) * 4] * 3
    assert prof.output_bytes[:2] == [32 * 64 * 4] * 2


def test_heavy_stage_measures_heavier_and_auto_uses_it():
    torch.manual_seed(0)
    mods = [mlp(64, 128), mlp(64, 128), mlp(64, 128), mlp(64, 4096)]  # a 32x heavier last stage
    costs = profile(mods, (torch.randn(256, 64),), warmup=1, repeats=3)
    assert isinstance(costs, Costs)
    assert len(costs.f) == len(costs.b) == len(costs.w) == 4
    assert all(v > 0 for v in costs.f + costs.w)
    assert costs.f[3] > 4 * costs.f[1] and costs.w[3] > 4 * costs.w[1]
    assert costs.comm == 0.0  # single process: no point-to-point to measure
    sched = build_schedule("auto", 4, 8, costs=costs, time_budget=None, iterations=10)
    validate(sched)
    assert simulate(sched, costs).makespan <= simulate(build_schedule("1f1b", 4, 8), costs).makespan


def test_given_comm_and_all_to_all():
    mods = [mlp(16, 16), mlp(16, 16)]
    costs = profile(mods, (torch.randn(4, 16),), repeats=1, comm=0.25, a2a=[0.0, 0.5])
    assert costs.comm == 0.25 and costs.a2a_f == [0.0, 0.5] and costs.a2a_b == [0.0, 0.5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="profile needs warmup >= 0 and repeats >= 1, got warmup=0, repeats=0"):
        profile([mlp(8, 8)], (torch.randn(2, 8),), warmup=0, repeats=0)
    with pytest.raises(ValueError, match="at least one stage module"):
        profile([], (torch.randn(2, 8),))


def _measure_comm(rank: int, world: int) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    mods = [mlp(64, 64), mlp(64, 64)]
    mods[1].moe_layers = 2
    costs = profile(mods, (torch.randn(64, 64),), warmup=0, repeats=1, a2a_bytes=1 << 16)
    return costs.comm, costs.a2a_f


@pytest.mark.slow
def test_comm_and_all_to_all_measured_between_two_ranks():
    got = run_ranks(_measure_comm, 2, timeout=120)
    (comm0, a2a0), (comm1, a2a1) = got
    assert comm0 > 0 and comm0 == comm1  # rank 0's ping-pong, broadcast to every rank
    assert a2a0 == a2a1 and a2a0[0] > 0  # the slowest rank's all-to-all, on every rank
    assert a2a0[1] == pytest.approx(2 * a2a0[0])  # charged once per MoE layer of the stage
