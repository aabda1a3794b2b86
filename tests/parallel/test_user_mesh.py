"""A user's own DeviceMesh: read by its dimension names (parallel/mesh_roles.py), trained on as init_parallel's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mt_dualpipe.parallel import init_parallel
from mt_dualpipe.parallel.mesh_roles import MeshRoles, canonical_order
from mt_dualpipe.runtime import Pipeline
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import global_batch, local_loss, make_model, reference

M = 4


@pytest.mark.parametrize("names,sizes,want", [
    (("dp", "pp"), (2, 2), MeshRoles(2, 2, 1, 1, ((1,), (0,), (), ()))),
    (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 4, 1, 2),  # torchtitan's dense mesh
     MeshRoles(2, 8, 1, 2, ((0,), (1, 2), (), (4,)))),
    (("pp", "dp_replicate", "efsdp", "ep", "tp"), (4, 1, 2, 8, 1),  # torchtitan's expert mesh
     MeshRoles(4, 2, 8, 1, ((0,), (1, 2), (3,), (4,)))),
    (("pp", "dp", "tp"), (8, 16, 1), MeshRoles(8, 16, 1, 1, ((0,), (1,), (), (2,)))),  # Megatron's, dp flattened
    (("tp", "fsdp", "pp"), (2, 2, 2), MeshRoles(2, 2, 1, 2, ((2,), (1,), (), (0,)))),  # any order
])
def test_dimension_names_map_to_roles(names, sizes, want):
    assert canonical_order(names, sizes) == want


@pytest.mark.parametrize("names,sizes,message", [
    (None, (4,), "the DeviceMesh has no dimension names: build it with mesh_dim_names=(...) naming each dimension "
                 "one of pp, dp, dp_replicate, dp_shard, fsdp, efsdp, ep, tp, cp"),
    (("dp", "tp"), (2, 2), "the mesh (dp=2, tp=2) has no pipeline dimension: name one of its dimensions 'pp' "
                           "(a pipeline of one stage per rank needs pp=1 to be named too)"),
    (("pp", "data"), (2, 2), "mesh dimension 'data' has no role in the pipeline runtime; the names it reads are pp, "
                             "dp, dp_replicate, dp_shard, fsdp, efsdp, ep, tp, cp (torchtitan's and Megatron's)"),
    (("pp", "dp", "dp_shard"), (2, 2, 2), "the mesh (pp=2, dp=2, dp_shard=2) is ambiguous: it names both 'dp' and "
                                          "'dp_shard', which would count data-parallel ranks twice"),
    (("pp", "tp", "tp"), (2, 1, 1), "the mesh (pp=2, tp=1, tp=1) is ambiguous: it names 'tp' twice; give each "
                                    "dimension its own name"),
    (("pp", "cp"), (2, 2), "the mesh has cp=2: context parallelism is not run by the pipeline runtime"),
])
def test_a_mesh_without_clear_roles_is_one_error(names, sizes, message):
    with pytest.raises(ValueError) as info:
        canonical_order(names, sizes)
    assert str(info.value).startswith(message)


def _train(mesh, mode: str) -> float:
    """One SGD step of a pp=2 x dp=2 pipeline on ``mesh``; the largest difference from one process."""
    dims = init_parallel(mesh=mesh)
    pp, dp = dims.coord("pp"), dims.coord("dp")
    model = make_model()
    modules = [model[pp]]
    if mode == "fsdp":
        modules = [fully_shard(modules[0], mesh=mesh["dp_shard"])]
    pipe = Pipeline(modules, "1f1b", mesh=mesh, dp_mode=mode, dp_batch="local")
    assert (pipe.mesh.pp, pipe.mesh.dp) == (2, 2) and pipe.mesh_ranks == (0, 1, 2, 3)
    opt = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    x, y = global_batch(1)
    rows = x.shape[0] // 2
    x, y = x[dp * rows:(dp + 1) * rows], y[dp * rows:(dp + 1) * rows]
    pipe.step(*((x,) if pp == 0 else ()), num_chunks=M, criterion=lambda out, t: local_loss(out, t, rows),
              labels=(y,) if pp == 1 else ())
    opt.step()
    ref = reference(1, "sgd")[pp]
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in modules[0].parameters()]
    return max((a.detach() - b).abs().max().item() for a, b in zip(got, ref.parameters()))


def _user_meshes(rank: int, world: int) -> dict:
    out = {}
    # dp outermost: the pipeline's ranks are {0, 1} and {2, 3}, not what init_parallel would lay out
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out["pp_group"] = sorted(torch.distributed.get_process_group_ranks(init_parallel(mesh=plain).group("pp")))
    out["allreduce"] = _train(plain, "allreduce")
    titan = init_device_mesh("cpu", (2, 1, 2, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    out["fsdp"] = _train(titan, "fsdp")
    titan[("dp_replicate", "dp_shard")]._flatten("dp")  # torchtitan's flattened data-parallel dimension
    flat = init_parallel(mesh=titan["pp", "dp"])
    out["flat"] = (flat.pp, flat.dp, sorted(torch.distributed.get_process_group_ranks(flat.group("dp"))))
    try:
        init_parallel(mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def test_pipeline_trains_on_the_users_mesh_as_on_init_parallels():
    out = run_ranks(_user_meshes, 4, timeout=120)
    for rank, o in enumerate(out):
        assert o["pp_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert o["allreduce"] < 1e-12 and o["fsdp"] < 1e-12, o
        assert o["flat"] == (2, 2, [0, 1] if rank < 2 else [2, 3])  # pp outermost in that mesh
        assert o["error"].startswith("the mesh (dp=4) has no pipeline dimension")
