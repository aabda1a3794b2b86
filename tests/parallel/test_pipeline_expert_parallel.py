"""Expert parallelism through the Pipeline: ``Pipeline(mesh=init_parallel(pp, dp, ep))``.

The toy (``tests.helpers.parallel.ExpertModel``) has one dense linear and ``ep`` experts per
stage; ep rank ``e`` holds expert ``e`` (marked ``"expert"``) and sends every row to every
expert through a differentiable all-to-all over ``dims.group("ep")``. The global batch splits
over the ``dp * ep`` replicas; dense weights reduce over copies x dp x ep, expert weights over
copies x dp, both divided by dp x ep. After one SGD step (``pipe.build_optimizer``) every
parameter must equal the single-process model stepped on the global batch, for a linear
schedule, a V and DualPipe (mirrored stages), and each kind must reduce over exactly its group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.parallel import GradSync, StageSync, init_parallel, set_weight_kind, weight_kind
from mt_dualpipe.runtime import DualPipe, Pipeline, defer_weight_grads
from mt_dualpipe.schedules.registry import schedule_info
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import (
    GLOBAL_ROWS,
    ExpertModel,
    TiedModel,
    adamw,
    error_message,
    global_batch,
    local_loss,
    make_model,
    pipeline_share,
    reference_step,
    sgd,
)

M = 4
SCHEDULES = ["1f1b", "zbv", "dualpipe"]


def _groups(sync) -> dict[str, tuple[int, ...]]:
    """Per weight kind, the global ranks the stage's gradients of that kind reduce over."""
    parts = sync.parts if isinstance(sync, StageSync) else [sync]
    assert all(isinstance(p, GradSync) for p in parts)
    return {weight_kind(p.params[0]): tuple(dist.get_process_group_ranks(p.group)) for p in parts}


def _worker(rank: int, world: int, name: str, dp: int, ep: int, mode: str, optimizer: str = "sgd",
            steps: int = 1) -> dict:
    dims = init_parallel(pp=2, dp=dp, ep=ep)
    pp, e = dims.coord("pp"), dims.coord("ep")
    replica, replicas = dims.coord("dp") * ep + e, dp * ep
    placement = schedule_info(name).layout(2, M).ranks
    n = max(len(c) for c in placement)
    model = ExpertModel(n, ep)
    local = [(c, s) for c, chain in enumerate(placement) for s, r in enumerate(chain) if r == pp]
    modules = [defer_weight_grads(model.stage(s, e, dims.group("ep"))) for _, s in local]
    x, y = global_batch(1, GLOBAL_ROWS)
    if len(placement) > 1:  # DualPipe: each end feeds its own half of the replica's rows
        pipe = DualPipe(tuple(modules), mesh=dims, dp_mode=mode, dp_batch="local")
        inputs, labels = pipeline_share(placement, pp, replica, replicas, x, y)
    else:  # the global batch: the pipeline takes replica dp*ep + ep's share itself
        pipe = Pipeline(modules, name, mesh=dims, dp_mode=mode)
        inputs = (x,) if pipe.needs_inputs else ()
        labels = (y,) if pipe.needs_labels else ()
    opt = pipe.build_optimizer(sgd if optimizer == "sgd" else adamw)
    rows = GLOBAL_ROWS // replicas
    for _ in range(steps):
        opt.zero_grad()
        pipe.step(*inputs, num_chunks=M, criterion=lambda o, t: local_loss(o, t, rows), labels=labels)
        opt.step()
    ref = reference_step(ExpertModel(n, ep), x, y, optimizer, steps)
    diff = 0.0
    for (_, s), m in zip(local, pipe.module):
        pairs = list(zip(m.dense.parameters(), ref.dense[s].parameters()))
        pairs += list(zip(m.expert.parameters(), ref.expert_params(s, e)))
        diff = max([diff] + [(a.detach() - b.detach()).abs().max().item() for a, b in pairs])
    groups = {cs: _groups(pipe.grad_syncs[cs]) for cs in local}
    return {"diff": diff, "groups": groups, "state": opt.state_bytes()}


def _rank(pp: int, dp: int, e: int, sizes: tuple[int, int]) -> int:
    """Global rank of mesh coordinate (pp, dp, ep) (pp outermost, tp = 1)."""
    return (pp * sizes[0] + dp) * sizes[1] + e


def _expected_groups(name: str, rank: int, dp: int, ep: int) -> dict:
    """dense: every rank holding the stage (copies) at every dp and ep coordinate; expert: same ep only."""
    placement = schedule_info(name).layout(2, M).ranks
    pp, d, e = rank // (dp * ep), (rank // ep) % dp, rank % ep
    out = {}
    for c, chain in enumerate(placement):
        for s, r in enumerate(chain):
            if r != pp:
                continue
            holders = sorted({ch[s] for ch in placement})
            dense = tuple(sorted(_rank(h, i, j, (dp, ep)) for h in holders for i in range(dp) for j in range(ep)))
            expert = tuple(sorted(_rank(h, i, e, (dp, ep)) for h in holders for i in range(dp)))
            out[(c, s)] = {"dense": dense, "expert": expert}
    del d
    return out


def _every_schedule(rank: int, world: int) -> dict:
    return {name: _worker(rank, world, name, 1, 2, "allreduce") for name in SCHEDULES}


def test_pp2_ep2_one_sgd_step_equals_single_process() -> None:
    """Every schedule of SCHEDULES in one spawn of 4 ranks (process start-up dominates a case)."""
    out = run_ranks(_every_schedule, 4, timeout=240)
    for name in SCHEDULES:
        assert max(o[name]["diff"] for o in out) < 1e-12, (name, [o[name]["diff"] for o in out])
        for rank, o in enumerate(out):
            assert o[name]["groups"] == _expected_groups(name, rank, 1, 2), name


def _both_modes(rank: int, world: int, name: str) -> dict:
    modes = ("allreduce", "zero1", "allreduce_bf16")
    return {mode: _worker(rank, world, name, 1, 2, mode, "adamw", 2) for mode in modes}


def test_zero1_shards_each_kind_over_its_group_and_equals_single_process_adamw() -> None:
    """DualPipe, PP2 x EP2: dense state shards over copies x ep (4 ranks), expert state over copies (2)."""
    out = run_ranks(_both_modes, 4, "dualpipe", timeout=150)
    for rank, o in enumerate(out):
        for mode in ("allreduce", "zero1"):
            assert o[mode]["diff"] < 1e-10, (mode, o[mode]["diff"])
        assert 1e-9 < o["allreduce_bf16"]["diff"] < 5e-3, o["allreduce_bf16"]["diff"]  # bfloat16 on the wire
        assert o["allreduce_bf16"]["groups"] == o["allreduce"]["groups"]
        assert o["zero1"]["groups"] == _expected_groups("dualpipe", rank, 1, 2)
        # dense and expert parameters are the same size here: (1/4 + 1/2) / 2 of the moments, + step counters
        assert o["zero1"]["state"] < 0.45 * o["allreduce"]["state"], o


@pytest.mark.slow
def test_pp2_dp2_ep2_dualpipe_equals_single_process() -> None:
    """8 processes: dense over copies x dp x ep (all 8 ranks), experts over copies x dp (4)."""
    out = run_ranks(_worker, 8, "dualpipe", 2, 2, "allreduce", timeout=300)
    assert max(o["diff"] for o in out) < 1e-12, [o["diff"] for o in out]
    for rank, o in enumerate(out):
        assert o["groups"] == _expected_groups("dualpipe", rank, 2, 2)


def _errors(rank: int, world: int) -> dict:
    out = {"mesh_size": error_message(lambda: init_parallel(pp=2, ep=3))}
    dims = init_parallel(pp=2, ep=2)
    pp, e = dims.coord("pp"), dims.coord("ep")
    out["no_expert"] = error_message(lambda: Pipeline([make_model(blocks=2)[pp]], "1f1b", mesh=dims))
    stage = ExpertModel(2, 2).stage(pp, e, dims.group("ep"))
    out["fsdp_ep"] = error_message(lambda: Pipeline([stage], "1f1b", mesh=dims, dp_mode="fsdp"))
    tied = TiedModel(2).stage(pp)
    set_weight_kind(tied.block.a, "expert")
    out["fsdp_ties"] = error_message(lambda: Pipeline([tied], "1f1b", mesh=dims, dp_mode="fsdp"))
    set_weight_kind(tied.tied, "expert")
    out["expert_tie"] = error_message(lambda: Pipeline([tied], "1f1b", mesh=dims))
    pipe = Pipeline([stage], "1f1b", mesh=dims)
    x = torch.randn(7, 8, dtype=torch.float64)
    out["batch"] = error_message(lambda: pipe.step(x, num_chunks=2, criterion=lambda o, t: local_loss(o, t, 2),
                                                   labels=(x,)))
    return out


def test_bad_input_messages() -> None:
    out = run_ranks(_errors, 4, timeout=120)
    for rank, o in enumerate(out):
        assert o["mesh_size"] == "world size 4 != pp*dp*ep*tp = 2*1*3*1 = 6"
        assert o["no_expert"].startswith("the mesh has ep=2 but no parameter of the pipeline's stages is marked "
                                         "'expert': mark the routed experts"), o["no_expert"]
        assert o["fsdp_ep"].startswith("dp_mode='fsdp' with ep=2 is not supported"), o["fsdp_ep"]
        assert o["fsdp_ties"].startswith("dp_mode='fsdp' cannot reduce tied parameters (tied.bias, tied.weight)")
        first_holder = "rank 0" if rank % 2 == 0 else "pipeline rank 0 (global rank 1)"  # of this rank's pp group
        assert o["expert_tie"] == (f"{first_holder}, stage (chain 0, stage 0): tied parameter 'tied.weight' is marked "
                                   "'expert' in TiedStage: expert weights are sharded over ep, only dense weights can "
                                   "be tied"), o["expert_tie"]
        assert o["batch"] == ("inputs of shape (7, 8): a global batch of 7 rows along batch_dim=0 does not split "
                              "over the dp*ep = 1*2 = 2 data-parallel replicas; use a batch size divisible by 2 (or "
                              "dp_batch='local' and pass each replica's own batch)"), o["batch"]
