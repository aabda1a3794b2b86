"""Weights tied across pipeline stages (``tied_parameters``): one weight, its copies' gradients summed once.

The toy (``tests.helpers.parallel.TiedModel``) uses one linear at both ends of its blocks; the
pipeline's first and last stages each hold a copy. After one SGD step every copy, and every
other parameter, must equal the single-process model stepped on the global batch — for a
linear schedule (1f1b: the copies on two ranks), a V (zbv: both copies on rank 0) and DualPipe
(each rank holds both ends, mirrored: four copies), without a mesh and with dp=2. ZeRO-1
with ties equals the single-process AdamW run too (the tie stepped once, copies kept equal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.runtime import DualPipe, Pipeline, PipelineError, defer_weight_grads
from mt_dualpipe.schedules.registry import schedule_info
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import (
    GLOBAL_ROWS,
    TiedModel,
    error_message,
    global_batch,
    local_loss,
    pipeline_share,
    reference_step,
)

M = 4
SCHEDULES = ["1f1b", "zbv", "dualpipe"]


def _pipeline(name: str, dp: int | None, mode: str, share: bool = False):
    """This rank's pipeline over fresh copies of ``TiedModel``'s stages (``dp=None``: no mesh).

    ``share``: stages on one rank use one ``tied`` module (the same Parameter objects) instead of copies."""
    dims = init_parallel(pp=2, dp=dp) if dp else None
    pp = dims.coord("pp") if dims else dist.get_rank()
    placement = schedule_info(name).layout(2, M).ranks
    n = max(len(c) for c in placement)
    model = TiedModel(n)
    local = [s for c, chain in enumerate(placement) for s, r in enumerate(chain) if r == pp]
    modules = [defer_weight_grads(model.stage(s)) for s in local]
    holding = [m for m in modules if hasattr(m, "tied")]
    if share:
        for m in holding[1:]:
            m.tied = holding[0].tied
    opts = {"mesh": dims, "dp_mode": mode if dims else None, "dp_batch": "local"}
    pipe = DualPipe(tuple(modules), **opts) if name == "dualpipe" else Pipeline(modules, name, **opts)
    return dims, pipe, placement, local, n


def _train(name: str, dp: int | None, mode: str, optimizer: str, steps: int, share: bool = False) -> dict:
    dims, pipe, placement, local, n = _pipeline(name, dp, mode, share)
    pp, replica = (dims.coord("pp"), dims.coord("dp")) if dims else (dist.get_rank(), 0)
    replicas = dp or 1
    factory = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer == "sgd" else (
        lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
    opt = pipe.build_optimizer(factory)
    x, y = global_batch(1, GLOBAL_ROWS)
    rows = GLOBAL_ROWS // replicas
    for _ in range(steps):
        opt.zero_grad()
        inputs, labels = pipeline_share(placement, pp, replica, replicas, x, y)
        pipe.step(*inputs, num_chunks=M, criterion=lambda o, t: local_loss(o, t, rows), labels=labels)
        opt.step()
    ref = reference_step(TiedModel(n), x, y, optimizer, steps)
    diff = 0.0
    for s, m in zip(local, pipe.module):
        for a, b in zip(m.block.parameters(), ref.blocks[s].parameters()):
            diff = max(diff, (a.detach() - b.detach()).abs().max().item())
        if hasattr(m, "tied"):
            for a, b in zip(m.tied.parameters(), ref.tied.parameters()):
                diff = max(diff, (a.detach() - b.detach()).abs().max().item())
    ties = [(t.names, t.holders, t.stages) for t in pipe.ties]
    return {"diff": diff, "ties": ties, "state": opt.state_bytes(), "names": sorted(opt.state_dict()["state"]),
            "tie_posted": sum(t.collectives_posted for t in pipe.reductions.ties)}


def _worker(rank: int, world: int, name: str, dp: int | None, mode: str = "allreduce", optimizer: str = "sgd",
            steps: int = 1, share: bool = False) -> dict:
    return _train(name, dp, mode, optimizer, steps, share)


def _expected_tie(name: str) -> tuple:
    placement = schedule_info(name).layout(2, M).ranks
    n = max(len(c) for c in placement)
    stages = tuple(sorted((c, s) for c, chain in enumerate(placement) for s in (0, n - 1) if s < len(chain)))
    holders = tuple(sorted({placement[c][s] for c, s in stages}))
    return (("tied.bias", "tied.weight"), holders, stages)


def _every_schedule(rank: int, world: int, dp: int | None) -> dict:
    """Every schedule of SCHEDULES in one spawn (process start-up dominates a case)."""
    return {name: _train(name, dp, "allreduce", "sgd", 1, False) for name in SCHEDULES}


def test_tied_weights_without_mesh_equal_single_process() -> None:
    out = run_ranks(_every_schedule, 2, None, timeout=180)
    for name in SCHEDULES:
        assert max(o[name]["diff"] for o in out) < 1e-12, (name, [o[name]["diff"] for o in out])
        assert all(o[name]["ties"] == [_expected_tie(name)] for o in out), name


def test_one_tied_module_shared_by_two_local_stages_counts_once() -> None:
    """zbv without a mesh, rank 0's first and last stage holding the *same* Parameter objects."""
    out = run_ranks(_worker, 2, "zbv", None, "allreduce", "sgd", 1, True, timeout=120)
    assert max(o["diff"] for o in out) < 1e-12, [o["diff"] for o in out]
    assert out[0]["ties"] == [_expected_tie("zbv")]


def test_tied_weights_with_dp2_equal_single_process() -> None:
    out = run_ranks(_every_schedule, 4, 2, timeout=240)
    for name in SCHEDULES:
        assert max(o[name]["diff"] for o in out) < 1e-12, (name, [o[name]["diff"] for o in out])
        # the tie is one all-reduce per step over its copies x the replicas (every holder rank posts it); zbv's
        # copies are all on pipeline rank 0, i.e. global ranks 0 and 1 (pp outermost), which reduce over dp
        posted = [o[name]["tie_posted"] for o in out]
        assert posted == ([1, 1, 0, 0] if name == "zbv" else [1, 1, 1, 1]), (name, posted)


def _both_modes(rank: int, world: int, name: str) -> dict:
    return {mode: _train(name, 2, mode, "adamw", 2) for mode in ("allreduce", "zero1", "allreduce_bf16")}


def test_zero1_with_ties_equals_single_process_adamw_and_shards_the_state() -> None:
    """DualPipe at dp=2: the tie's and the mirrored stages' state shard over copies x replicas (4 ranks)."""
    out = run_ranks(_both_modes, 4, "dualpipe", timeout=150)
    for o in out:
        for mode in ("allreduce", "zero1"):
            assert o[mode]["diff"] < 1e-10, (mode, o[mode]["diff"])
        # the tie and the mirrored copies reduced as bfloat16 on the wire: close to, not equal to, one process
        assert 1e-9 < o["allreduce_bf16"]["diff"] < 5e-3, o["allreduce_bf16"]["diff"]
        assert o["allreduce_bf16"]["state"] == o["allreduce"]["state"]
        assert o["zero1"]["state"] < 0.3 * o["allreduce"]["state"], o  # ~1/4 (+ AdamW's step counters)
        # one entry per weight, named the pipeline's way (both stages' blocks, the tie once)
        blocks = [f"stage{s}.block.{n}" for s in (0, 1) for n in ("a.bias", "a.weight", "b.bias", "b.weight")]
        assert o["zero1"]["names"] == o["allreduce"]["names"] == sorted(blocks + ["tied.tied.bias", "tied.tied.weight"])


def _errors(rank: int, world: int) -> dict:
    model = TiedModel(2)
    out = {}
    wide = model.stage(rank)
    if rank == 1:
        wide.tied = torch.nn.Linear(8, 4).double()
    out["shape"] = error_message(lambda: Pipeline([wide], "1f1b"), (PipelineError,))
    typo = model.stage(rank)
    typo.tied_parameters = ("tied.wieght",) if rank == 0 else ()
    out["typo"] = error_message(lambda: Pipeline([typo], "1f1b"), (PipelineError,))
    pipe = DualPipe((model.stage(rank), model.stage(1 - rank)))
    out["mirrored"] = error_message(pipe.sync_mirrored_grads, (PipelineError,))
    return out


def test_bad_ties_are_refused_on_every_rank() -> None:
    out = run_ranks(_errors, 2, timeout=90)
    for rank, o in enumerate(out):
        assert o["shape"] == ("tied parameter 'tied.bias' differs between its copies (rank 0, stage (chain 0, "
                              "stage 0) 'tied.bias': shape (8,), torch.float64; rank 1, stage (chain 0, stage 1) "
                              "'tied.bias': shape (4,), torch.float64); tied copies must have one shape and dtype"), \
            o["shape"]
        assert o["typo"] == ("tied_parameters names 'tied.wieght', which no stage module holds; a tuple names "
                             "parameters by their FQN within the stage module (as in module.named_parameters()), a "
                             "{FQN: key} mapping ties them under key")
        assert o["mirrored"] == (f"rank {rank}: this DualPipe was built with tied_parameters, so step() already "
                                 "summed the mirrored copies at each stage's REDUCE_GRAD; do not call "
                                 "sync_mirrored_grads()")
