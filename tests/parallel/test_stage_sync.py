"""The stage-sync contract (parallel/stage_sync.py): every sync class answers it, and the mode table is the one list."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mt_dualpipe.parallel.fsdp import FSDPStageSync
from mt_dualpipe.parallel.grad_sync import MODES, GradSync, StageSync, TiedSync
from mt_dualpipe.parallel.stage_sync import (
    DP_MODES,
    GroupUse,
    RetakesParameters,
    StageGradSync,
    get_mode,
    mode_for_zero_stage,
)
from mt_dualpipe.parallel.zero import PipelineOptimizer, ZeroOptimizer
from tests.helpers.dist import run_ranks


def test_the_mode_table_is_the_one_list():
    assert list(DP_MODES) == ["allreduce", "zero1", "fsdp", "allreduce_bf16"]
    assert set(MODES) == {m.name for m in DP_MODES.values() if not m.needs_fully_shard}
    assert [mode_for_zero_stage(z).name for z in (0, 1, 3)] == ["allreduce", "zero1", "fsdp"]
    assert not DP_MODES["fsdp"].expert_parallel and not DP_MODES["fsdp"].tied_weights
    with pytest.raises(ValueError, match=r"^unknown data-parallel mode 'zero2'; allowed: allreduce, zero1, fsdp, "
                                         r"allreduce_bf16$"):
        get_mode("zero2")
    with pytest.raises(ValueError, match=r"^no data-parallel mode runs ZeRO stage 2; allowed: 0, 1, 3$"):
        mode_for_zero_stage(2)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()


def _backward(model: nn.Module, rank: int) -> None:
    torch.manual_seed(100 + rank)
    model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()


def _contract(rank: int, world: int) -> dict:
    out: dict = {}
    everyone = tuple(range(world))
    # all-reduce, then the same after its group is replaced by a fresh one over the same ranks
    model = _model()
    sync = GradSync(model, None, key=("stage", 0, "dense"))
    out["is_contract"] = [isinstance(s, StageGradSync) for s in (sync, StageSync((0, 0), [sync]))]
    out["groups"] = sync.process_groups()
    fresh = dist.new_group(list(everyone))
    sync.replace_group(("stage", 9, "dense"), fresh)  # another key: untouched
    out["kept"] = sync.group is None
    sync.replace_group(("stage", 0, "dense"), fresh)
    out["replaced"] = sync.group is fresh
    _backward(model, rank)
    sync.sync()
    out["allreduce_grad"] = model[0].weight.grad.clone()
    out["allreduce_shards"] = sync.reduced_shards()
    info = sync.describe()
    out["info"] = (info.mode, info.num_params, info.numel, info.buckets, info.divide_by)
    try:
        sync.replace_group(("stage", 0, "dense"), dist.new_group([0]))
    except ValueError as exc:
        out["wrong_ranks"] = str(exc)
    # allreduce_bf16: the buckets travel as bfloat16, the average lands in the gradient's dtype
    model = _model().float()
    bsync = GradSync(model, None, mode="allreduce_bf16")
    torch.manual_seed(100 + rank)
    model(torch.randn(5, 4)).square().sum().backward()
    out["bf16_local"] = model[0].weight.grad.clone()
    bsync.sync()
    out["bf16_grad"] = model[0].weight.grad.clone()
    out["bf16_wire"] = (bsync.wire_dtype, bsync.collectives_posted)
    # zero1: shards appear only after wait(); a StageSync of a part and a tie lists every group once
    model = _model()
    zsync = GradSync([model[0].weight, model[0].bias, model[1].weight], None, mode="zero1", key=("stage", 0, "dense"))
    tie = TiedSync([[model[1].bias]], [(0, 0)], None, names=("head.bias",))  # one copy, no replicas: local only
    stage = StageSync((0, 0), [zsync], [tie], mode="zero1")
    opt = PipelineOptimizer([("stage0.0.weight", model[0].weight, zsync), ("stage0.0.bias", model[0].bias, zsync),
                             ("stage0.1.weight", model[1].weight, zsync), ("tied.head.bias", model[1].bias, None)],
                            lambda ps: torch.optim.SGD(ps, lr=0.1), "zero1", [tie])
    out["retakes"] = [isinstance(o, RetakesParameters) for o in (opt, ZeroOptimizer(zsync, lambda ps: torch.optim.SGD(
        ps, lr=0.1)), torch.optim.SGD(model.parameters(), lr=0.1))]
    stage.begin_step()
    _backward(model, rank)
    out["before"] = len(stage.reduced_shards())
    stage.start()
    stage.wait()
    out["zero1_shards"] = [t.clone() for t in stage.reduced_shards()]
    out["zero1_info"] = stage.describe().mode, stage.pending, stage.synced
    out["stage_groups"] = stage.process_groups()
    # FSDP2
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = _model()
    fully_shard(model, mesh=mesh)
    fsync = FSDPStageSync(model, key=("stage", 0, "fsdp"))
    out["fsdp_is_contract"] = isinstance(fsync, StageGradSync)
    fsync.begin_step()
    _backward(model, rank)
    fsync.start()
    out["fsdp_pending"] = fsync.pending, fsync.synced
    fsync.wait()
    out["fsdp_done"] = fsync.pending, fsync.synced, fsync.reduced_shards(), fsync.process_groups()
    out["fsdp_info"] = fsync.describe().mode, fsync.describe().numel, fsync.describe().buckets
    fsync.end_step()
    return out


def test_every_sync_answers_the_contract():
    results = run_ranks(_contract, 2, timeout=90)
    ref = _model()
    for rank in (0, 1):
        _backward(ref, rank)
    everyone = (0, 1)
    for r in results:
        assert r["is_contract"] == [True, True] and r["fsdp_is_contract"]
        assert r["groups"] == [GroupUse(("stage", 0, "dense"), everyone)]
        assert r["kept"] and r["replaced"]
        torch.testing.assert_close(r["allreduce_grad"], ref[0].weight.grad / 2)  # the fresh group reduced it
        assert r["allreduce_shards"] == []  # all-reduce leaves the gradient in .grad
        assert r["info"] == ("allreduce", 4, 4 * 6 + 6 + 6 * 3 + 3, 1, 2)
        assert r["wrong_ranks"] == "group ('stage', 0, 'dense'): a replacement must span ranks [0, 1], got [0]"
        assert r["retakes"] == [True, True, False]
        assert r["before"] == 0
        # this rank's chunk of each of the 3 parameters the GradSync holds (the tie has no group: nothing sharded)
        assert len(r["zero1_shards"]) == 3
        assert r["zero1_info"] == ("zero1", False, True)
        assert r["stage_groups"] == [GroupUse(("stage", 0, "dense"), everyone)]
        assert r["fsdp_pending"] == (True, False)
        assert r["fsdp_done"] == (False, True, [], [GroupUse(("stage", 0, "fsdp"), everyone)])
        assert r["fsdp_info"] == ("fsdp", 4 * 6 + 6 + 6 * 3 + 3, 1)
    a, b = (r["bf16_local"].bfloat16() for r in results)
    for r in results:  # one bfloat16 add per element (2 ranks), then the division in float32
        assert r["bf16_wire"] == (torch.bfloat16, 1)
        assert r["bf16_grad"].dtype == torch.float32
        torch.testing.assert_close(r["bf16_grad"], (a + b).float() / 2, rtol=0, atol=0)
    exact = (results[0]["bf16_local"] + results[1]["bf16_local"]) / 2
    assert not torch.equal(results[0]["bf16_grad"], exact)  # it did travel as bfloat16
    torch.testing.assert_close(results[0]["bf16_grad"], exact, rtol=2**-7, atol=1e-6)
    w = ref[0].weight.grad / 2
    torch.testing.assert_close(torch.cat([results[0]["zero1_shards"][0], results[1]["zero1_shards"][0]]), w)
