"""A stage without a trainable parameter runs as a pass-through under every schedule and dp mode.

Such a stage (a parameter-free transform, or what a too-deep split of a model leaves) has nothing
to reduce: the pipeline gives it no gradient sync (nor asks for ``fully_shard``), and a rank whose
stages hold nothing trainable gets an optimizer that steps nothing. On PP2 x DP2 (4 gloo ranks,
fp64) 1F1B (rank 1 holds only the parameterless stage), ZB-V and DualPipe (its mirrored copy on
the other rank too) must, in every mode of ``DP_MODES``, end two AdamW steps with the parameters of
the same model on one process (exactly; allreduce_bf16 to its compression); without a mesh, 1F1B on
4 ranks the same.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mt_dualpipe.parallel.stage_sync import DP_MODES
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import Block, adamw, global_batch, local_loss

DP, M, STEPS = 2, 4, 2
EMPTY = 1  # the index of the parameterless stage in every chain
MESH_CASES = [(s, mode) for s in ("1f1b", "zbv", "dualpipe") for mode in DP_MODES]
TOLERANCE = {"allreduce_bf16": 5e-3}  # bfloat16 gradients on the wire (tests/runtime/test_hybrid.py says why)


class Squash(nn.Module):
    """A stage with no parameters that still computes (its gradient is not the identity's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.tanh(x)


def _model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Squash() if i == EMPTY else Block() for i in range(stages)]).double()


def _reference(stages: int, replicas: int) -> list[torch.Tensor]:
    """The model after ``STEPS`` AdamW steps on one process (loss: each replica's mean, averaged)."""
    model = _model(stages)
    opt = adamw(list(model.parameters()))
    for step in range(STEPS):
        x, y = global_batch(1 + step)
        opt.zero_grad()
        local_loss(model(x), y, x.shape[0]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _inputs(sched_name: str, placement, pp: int, step: int, replica: int, replicas: int) -> tuple[tuple, tuple]:
    """This rank's (inputs, labels) of the step: its replica's rows, each DualPipe end feeding one half."""
    x, y = global_batch(1 + step)
    n = x.shape[0] // replicas
    x, y = x[replica * n:(replica + 1) * n], y[replica * n:(replica + 1) * n]
    if sched_name == "dualpipe":
        xs, ys = x.chunk(2), y.chunk(2)
        return (xs[pp],), (ys[len(placement[0]) - 1 - pp],)
    first, last = placement[0][0] == pp, placement[0][-1] == pp
    return ((x,) if first else ()), ((y,) if last else ())


def _train(sched_name: str, mode: str | None, dims, pp: int, replica: int, replicas: int, num_ranks: int) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.schedules.registry import schedule_info

    placement = schedule_info(sched_name).layout(num_ranks).ranks
    model = _model(len(placement[0]))
    local = [(c, s) for c, chain in enumerate(placement) for s, r in enumerate(chain) if r == pp]
    modules = [copy.deepcopy(model[s]) for _, s in local]
    if mode is not None and DP_MODES[mode].needs_fully_shard:  # sharded: the stages with parameters only
        modules = [m if s == EMPTY else fully_shard(m, mesh=dims.submesh("dp")) for m, (_, s) in zip(modules, local)]
    mesh = {} if dims is None else {"mesh": dims, "dp_mode": mode, "dp_batch": "local"}
    pipe = Pipeline(modules, sched_name, timeout=30, **mesh)
    opt = pipe.build_optimizer(adamw)
    rows = global_batch(1)[0].shape[0] // replicas
    for step in range(STEPS):
        inputs, labels = _inputs(sched_name, placement, pp, step, replica, replicas)
        opt.zero_grad()
        pipe.step(*inputs, num_chunks=M, criterion=lambda out, t: local_loss(out, t, rows), labels=labels)
        opt.step()
    params = {s: [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in m.parameters()]
              for (_, s), m in zip(local, pipe.module)}
    return {"params": params, "syncs": {s: type(x).__name__ for (_, s), x in zip(local, pipe.stage_syncs)},
            "optimized": sum(p.numel() for g in opt.param_groups for p in g["params"])}


def _worker(rank: int, world: int) -> dict:
    from mt_dualpipe.parallel import init_parallel

    out = {}
    for sched_name, mode in MESH_CASES:
        dims = init_parallel(pp=world // DP, dp=DP)
        out[sched_name, mode] = _train(sched_name, mode, dims, dims.coord("pp"), dims.coord("dp"), DP, dims.pp)
    out["1f1b", None] = _train("1f1b", None, None, rank, 0, 1, world)  # no mesh: 4 pipeline ranks
    return out


def test_parameterless_stage_runs_as_pass_through_in_every_mode():
    results = run_ranks(_worker, 4, timeout=240)
    for (sched_name, mode), stages in [*((c, 4 if c[0] == "zbv" else 2) for c in MESH_CASES), (("1f1b", None), 4)]:
        want = _reference(stages, 1 if mode is None else DP)
        model = _model(stages)
        offsets = [sum(len(list(model[i].parameters())) for i in range(s)) for s in range(stages)]
        seen = set()
        for res in results:
            got = res[sched_name, mode]
            for s, params in got["params"].items():
                seen.add(s)
                expect = want[offsets[s]:offsets[s] + len(params)]
                assert len(params) == (0 if s == EMPTY else 4)
                for a, b in zip(params, expect):
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=TOLERANCE.get(mode, 1e-12),
                                               msg=f"{sched_name} {mode} stage {s}")
            alone = set(got["params"]) == {EMPTY}  # 1F1B's rank holding only the parameterless stage
            if mode is not None and EMPTY in got["syncs"]:  # no sync of its own: an empty StageSync, or none at all
                assert got["syncs"][EMPTY] == ("NoneType" if alone else "StageSync"), (sched_name, mode, got["syncs"])
            if alone:
                assert got["optimized"] == 0
        assert seen == set(range(stages)), (sched_name, mode, seen)
