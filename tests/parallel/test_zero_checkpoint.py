"""DCP checkpoints of ZeRO-1 state reshard across data-parallel sizes (dp=2 -> dp=1 and back)."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.parallel import GradSync, ZeroOptimizer, load_training_state, save_training_state
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import adamw, global_batch, local_loss, make_model, make_optimizer, replica_rows

SAVED_STEPS = 2


def _step(model, sync, opt, step: int, rank: int, world: int) -> None:
    x, y = global_batch(1 + step)
    sl = replica_rows(x, rank, world)
    local_loss(model(x[sl]), y[sl], x[sl].shape[0]).backward()
    if sync is not None:
        sync.start()
        sync.wait()
    opt.step()
    opt.zero_grad()


def _build(world: int, zero: bool, seed: int = 0):
    model = make_model(seed)
    if not zero:
        return model, None, make_optimizer("adamw", list(model.parameters()))
    sync = GradSync(model, mode="zero1")
    return model, sync, ZeroOptimizer.for_module(model, sync, adamw)


def _full_state(model, opt) -> dict:
    """name -> (exp_avg, exp_avg_sq, step) of a plain optimizer over ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: tuple(opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "step"))
            for p in model.parameters()}


def _save(rank: int, world: int, path: str, zero: bool) -> None:
    model, sync, opt = _build(world, zero)
    for step in range(SAVED_STEPS):
        _step(model, sync, opt, step, rank, world)
    save_training_state(path, model, opt)


def _load_and_continue(rank: int, world: int, path: str, zero: bool) -> dict:
    model, sync, opt = _build(world, zero, seed=123)  # different initial values: all must come from the file
    load_training_state(path, model, opt)
    loaded = [p.detach().clone() for p in model.parameters()]
    if zero:
        state = {n: tuple(opt.optimizer.state[s][k].clone() for k in ("exp_avg", "exp_avg_sq", "step"))
                 for n, s in zip(opt.names, opt.shards)}
    else:
        state = _full_state(model, opt)
    _step(model, sync, opt, SAVED_STEPS, rank, world)
    return {"loaded": loaded, "state": state, "after": [p.detach().clone() for p in model.parameters()]}


def _load_both(rank: int, world: int, path: str) -> list[dict]:
    """One process: load into a plain AdamW, then into a one-rank ZeroOptimizer."""
    return [_load_and_continue(rank, world, path, zero) for zero in (False, True)]


def _reference() -> tuple[list[torch.Tensor], dict, list[torch.Tensor]]:
    model, _, opt = _build(1, False)
    for step in range(SAVED_STEPS):
        _step(model, None, opt, step, 0, 1)
    saved = [p.detach().clone() for p in model.parameters()]
    state = _full_state(model, opt)
    _step(model, None, opt, SAVED_STEPS, 0, 1)
    return saved, state, [p.detach().clone() for p in model.parameters()]


def _close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # by default through Rewind's checkpoints: tests/resilience/test_checkpoint_mesh.py
def test_zero1_dp2_checkpoint_loads_at_dp1(tmp_path):
    saved, state, after = _reference()
    run_ranks(_save, 2, str(tmp_path / "ckpt"), True, timeout=90)
    (both,) = run_ranks(_load_both, 1, str(tmp_path / "ckpt"), timeout=60)
    for got in both:  # into a plain AdamW and into a one-rank ZeroOptimizer
        for a, b in zip(got["loaded"], saved):
            _close(a, b)
        assert got["state"].keys() == state.keys()
        for name, values in state.items():
            for a, b in zip(got["state"][name], values):
                _close(a, b)
        for a, b in zip(got["after"], after):
            _close(a, b)


@pytest.mark.slow  # both directions through Rewind in tests/resilience/test_checkpoint_mesh.py (dp2 -> dp1 by default)
def test_dp1_checkpoint_loads_into_zero1_at_dp2(tmp_path):
    saved, state, after = _reference()
    run_ranks(_save, 1, str(tmp_path / "ckpt"), False, timeout=60)
    out = run_ranks(_load_and_continue, 2, str(tmp_path / "ckpt"), True, timeout=90)
    for rank, got in enumerate(out):
        for a, b in zip(got["loaded"], saved):
            _close(a, b)
        for name, (exp_avg, exp_avg_sq, step) in state.items():
            rows = exp_avg.shape[0] // 2  # every parameter here has an even first dim: an even split
            mine = slice(rank * rows, (rank + 1) * rows)
            _close(got["state"][name][0], exp_avg[mine])
            _close(got["state"][name][1], exp_avg_sq[mine])
            _close(got["state"][name][2], step)
        for a, b in zip(got["after"], after):
            _close(a, b)
