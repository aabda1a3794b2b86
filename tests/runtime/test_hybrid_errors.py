"""Bad input to a pipeline on a mesh: each one a clear error naming the numbers (4 gloo ranks)."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.runtime import Pipeline
from mt_dualpipe.runtime.data_parallel import rank_label
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import error_message, local_loss, make_model


def _worker(rank: int, world: int) -> dict:
    out = {"mesh_size": error_message(lambda: init_parallel(pp=3, dp=1))}
    dims = init_parallel(pp=2, dp=2)
    pp = dims.coord("pp")
    block = make_model(blocks=2)[pp]
    out["inconsistent"] = error_message(lambda: Pipeline([block], "zb-h1", mesh=dataclasses.replace(dims, dp=1)))
    out["mode"] = error_message(lambda: Pipeline([block], "zb-h1", mesh=dims, dp_mode="zero2"))
    out["fsdp_plain"] = error_message(lambda: Pipeline([block], "zb-h1", mesh=dims, dp_mode="fsdp"))
    out["no_mesh"] = error_message(lambda: Pipeline([block], "zb-h1", dp_mode="zero1"))
    out["ddp"] = error_message(
        lambda: Pipeline([DistributedDataParallel(block, process_group=dims.group("dp"))], "zb-h1", mesh=dims))
    sharded = fully_shard(make_model(blocks=2)[pp], mesh=dims.submesh("dp"))
    out["fsdp_mode"] = error_message(lambda: Pipeline([sharded], "zb-h1", mesh=dims, dp_mode="zero1"))
    pipe = Pipeline([block], "zb-h1", mesh=dims)
    x = torch.randn(7, 8, dtype=torch.float64)

    def crit(o, t):
        return local_loss(o, t, 2)

    out["batch"] = error_message(lambda: pipe.step(x if pp == 0 else None, num_chunks=2, criterion=crit if pp else None,
                                          labels=(x,) if pp else ()))
    out["missing"] = error_message(lambda: pipe.step(None, num_chunks=2, criterion=crit if pp else None,
                                            labels=(x[:4],) if pp else ()))
    return out


def test_bad_input_messages() -> None:
    out = run_ranks(_worker, 4, timeout=120)
    for rank, o in enumerate(out):
        assert o["mesh_size"] == "world size 4 != pp*dp*ep*tp = 3*1*1*1 = 3"
        assert o["inconsistent"] == "the mesh has 4 ranks but pp*dp*ep*tp = 2*1*1*1 = 2; build it with init_parallel"
        assert o["mode"] == "unknown dp_mode 'zero2'; allowed: allreduce, zero1, fsdp, allreduce_bf16"
        assert o["no_mesh"] == "dp_mode='zero1' needs mesh= (mt_dualpipe.parallel.init_parallel(pp=..., dp=...))"
        pp, name = rank // 2, f"pipeline rank {rank // 2} (global rank {rank})" if rank else "rank 0"
        assert o["fsdp_plain"] == (f"{name}, stage (chain 0, stage {pp}): dp_mode='fsdp' needs stage modules wrapped "
                                   "with fully_shard(module, mesh=dims.submesh('dp')); got a plain Block")
        assert o["ddp"].startswith(f"{name}: stage module 0 is wrapped in DistributedDataParallel")
        assert "dp_mode='allreduce'" in o["ddp"] and "mesh=init_parallel" in o["ddp"]
        assert o["fsdp_mode"].startswith(f"{name}: stage module 0 (FSDPBlock) is wrapped with fully_shard, which "
                                         "needs dp_mode='fsdp' (got dp_mode='zero1')")
        assert o["batch"] == ("inputs of shape (7, 8): a global batch of 7 rows along batch_dim=0 does not split over "
                              "the dp=2 data-parallel replicas; use a batch size divisible by 2 (or dp_batch='local' "
                              "and pass each replica's own batch)") if pp == 0 else "labels" in o["batch"]
        if pp == 0:
            assert o["missing"] == f"{name} holds the first stage of chain 0 and needs the step's inputs"


def test_messages_name_both_ranks_only_when_they_differ() -> None:
    assert rank_label(1, 1) == "rank 1"
    assert rank_label(0, 2) == "pipeline rank 0 (global rank 2)"
