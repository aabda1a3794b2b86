"""DeepSeek-V3 on one pp x dp x ep mesh: the pipeline's own gradient sync against the single-process model.

Every worker builds the same seeded float64 model, runs the single-process reference over the whole
global batch itself (each replica's micro-batch losses backpropagated as is, averaged over the
dp x ep replicas: what ``Pipeline(mesh=)`` computes), then its own part of the parallel run: stages
on ``mesh_ep_group(dims)``, ``Pipeline(mesh=dims, dp_batch="local")``, one SGD step through
``pipe.build_optimizer``. Loss, every parameter after the step (dense, routed experts, the tied
embedding of the first and last stage, DualPipe's mirrored copies) and the expert loads summed by
``sync_expert_load`` must equal the reference.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.layers.expert_parallel import mesh_ep_group
from mt_dualpipe.layers.moe_state import moe_layers, set_aux_loss_scale
from mt_dualpipe.models.deepseek_v3 import (
    DeepSeekV3Config,
    DeepSeekV3Model,
    build_stages,
    criterion_for,
    expert_load_names,
    stages_for_rank,
    sync_expert_load,
)
from mt_dualpipe.parallel import weight_kind
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import assert_params_match, rank_micro_batches

LR = 0.5


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=4, vocab_size=128, inter_dim=128, moe_inter_dim=32, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


# ----- one process: what the stages declare ----------------------------------------------------------------
def test_stages_declare_the_tied_embedding_and_mark_routed_experts():
    config = small_config()
    torch.manual_seed(0)
    full = DeepSeekV3Model(config)
    stages = build_stages(config, 3, [2, 1, 1], source=full)
    # the MTP modules read the main embedding: the first and the last stage hold copies of it, the middle none
    assert [st.tied_parameters for st in stages] == [("model.embed_tokens.weight",), (), ("model.embed_tokens.weight",)]
    no_mtp = build_stages(small_config(mtp_depth=0), 2, [2, 2])  # only the first stage embeds: nothing to tie
    assert [st.tied_parameters for st in no_mtp] == [(), ()]
    for fp8 in (False, True):  # FP8 conversion replaces the linears: the marks are set again
        for st in build_stages(config, 2, [2, 2], source=full, fp8=fp8):
            kinds = {name: weight_kind(p) for name, p in st.named_parameters()}
            experts = [n for n in kinds if ".mlp.experts." in n]
            assert experts and all(kinds[n] == "expert" for n in experts)
            assert all(k == "dense" for n, k in kinds.items() if n not in experts)  # gate, shared experts too


def test_expert_load_names_are_the_models_buffers():
    config = small_config()
    model = DeepSeekV3Model(config)
    assert expert_load_names(config) == [n for n, _ in model.named_buffers() if n.endswith("gate.load")]
    assert expert_load_names(config) == ["model.layers.1.mlp.gate.load", "model.layers.2.mlp.gate.load",
                                         "model.layers.3.mlp.gate.load", "mtp.0.block.mlp.gate.load"]


def test_sync_expert_load_without_a_mesh_sums_this_ranks_copies_only():
    config = small_config()
    a, b = build_stages(config, 2, [2, 2]), build_stages(config, 2, [2, 2])
    for i, st in enumerate((a[1], b[1])):  # two copies of the last stage on one rank (as a V schedule could hold)
        for n, buf in st.named_buffers():
            if n.endswith("gate.load"):
                buf.fill_(i + 1)
    sync_expert_load([a[1], b[1]])
    loads = [buf for st in (a[1], b[1]) for n, buf in st.named_buffers() if n.endswith("gate.load")]
    assert len(loads) == 6 and all(torch.equal(t, torch.full_like(t, 3.0)) for t in loads)
    with pytest.raises(ValueError, match="sync_expert_load needs this rank's stage modules, got none"):
        sync_expert_load([])


def test_stages_for_rank_on_a_mesh_checks_the_rank_and_the_group():
    from types import SimpleNamespace

    from mt_dualpipe.schedules.registry import build_schedule

    config, sched = small_config(), build_schedule("1f1b", 2, 2)
    dims = SimpleNamespace(ep=1, coord=lambda dim: {"pp": 1}[dim])  # pp rank 1 of a mesh with ep = 1
    (stage,) = stages_for_rank(config, sched, 1, mesh=dims)
    assert stage.index == 1 and all(m.dispatcher.group is None for m in moe_layers(stage))
    with pytest.raises(ValueError, match=r"rank 0 is not this process's pipeline rank on the mesh \(1\)"):
        stages_for_rank(config, sched, 0, mesh=dims)
    with pytest.raises(ValueError, match="give stages_for_rank mesh= .* or ep_group=, not both"):
        stages_for_rank(config, sched, 1, mesh=dims, ep_group=object())


# ----- several processes: one SGD step on the mesh equals the single process -------------------------------
def _replica_data(config, replicas: int, num_mb: int, seq: int = 16) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(replicas):
        tokens = [torch.randint(0, config.vocab_size, (1, seq + 1), generator=g) for _ in range(num_mb)]
        out.append([(t[:, :-1], t[:, 1:]) for t in tokens])
    return out


def _reference(config, data, replicas: int) -> tuple[DeepSeekV3Model, dict, DeepSeekV3Model]:
    """(the seeded model before the step, the losses per (replica, micro-batch), the model after one SGD step)."""
    torch.manual_seed(0)
    start = DeepSeekV3Model(config)
    model = DeepSeekV3Model(config)
    model.load_state_dict(start.state_dict())
    set_aux_loss_scale(model, 1.0 / replicas)  # the balance loss is averaged over the replicas like the rest
    losses = {}
    for r, mbs in enumerate(data):
        for m, (x, y) in enumerate(mbs):
            loss = model(x, y)
            (loss / replicas).backward()
            losses[r, m] = loss.detach()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return start, losses, model


def _mesh_step(rank, world, pp, dp, ep, schedule, dp_mode, num_mb):
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.schedules.registry import build_schedule

    torch.set_default_dtype(torch.float64)
    config = small_config()
    replicas = dp * ep
    data = _replica_data(config, replicas, num_mb)
    start, ref_losses, ref = _reference(config, data, replicas)
    dims = init_parallel(pp=pp, dp=dp, ep=ep)
    sched = build_schedule(schedule, pp, num_mb)
    mods = stages_for_rank(config, sched, dims.coord("pp"), source=start, mesh=dims)
    if ep > 1:  # the experts shard over the mesh's ep group
        assert all(m.dispatcher.group is mesh_ep_group(dims) for m in moe_layers(torch.nn.ModuleList(mods)))
    mesh = {"mesh": dims, "dp_mode": dp_mode, "dp_batch": "local", "timeout": 60}
    pipe = DualPipe(tuple(mods), **mesh) if schedule == "dualpipe" else Pipeline(mods, sched, **mesh)
    opt = pipe.build_optimizer(lambda params: torch.optim.SGD(params, lr=LR))
    replica = dims.coord("dp") * ep + dims.coord("ep")
    inputs, labels, last = rank_micro_batches(sched, dims.coord("pp"), data[replica])
    opt.zero_grad()
    loss, _ = pipe.step(*inputs, num_chunks=num_mb, criterion=criterion_for(mods), labels=labels)
    opt.step()
    if last:
        want = torch.stack([ref_losses[replica, m] for m in sched.microbatches_of(last[0])])
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    checked = assert_params_match(mods, ref, f"{schedule}/{dp_mode}")
    sync_expert_load(mods, dims)
    for mod in mods:
        for name, buf in mod.named_buffers():
            if name.endswith("gate.load"):
                assert torch.equal(buf, ref.get_buffer(name)), f"{schedule}: {name} {buf} != {ref.get_buffer(name)}"
    experts = sorted({n.split(".experts.")[1].split(".")[0] for m in mods for n, _ in m.named_parameters()
                      if ".experts." in n}, key=int)
    return checked, experts


def _suite(rank, world, pp, dp, ep, cases):
    out = {}
    for schedule, dp_mode, num_mb in cases:
        try:
            out[schedule] = (None, _mesh_step(rank, world, pp, dp, ep, schedule, dp_mode, num_mb))
        except BaseException:
            out[schedule] = (traceback.format_exc(), None)
        dist.barrier()
    return out


def _check(per_rank: list[dict], name: str) -> list:
    errors = [f"rank {r}:\n{res[name][0]}" for r, res in enumerate(per_rank) if res[name][0] is not None]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res[name][1] for res in per_rank]


@pytest.fixture(scope="module")
def pp2_ep2():
    """pp=2 x ep=2 (dp=1): 4 processes, DualPipe with all-reduce and ZB-H1 with ZeRO-1, one spawn."""
    return run_ranks(_suite, 4, 2, 1, 2, [("dualpipe", "allreduce", 4), ("zb-h1", "zero1", 4)], timeout=240)


@pytest.mark.parametrize("schedule", ["dualpipe", "zb-h1"])
def test_pp2_ep2_one_step_equals_single_process(pp2_ep2, schedule):
    got = _check(pp2_ep2, schedule)
    for checked, _ in got:
        assert checked["expert"] > 0 and checked["dense"] > 0
    # global rank = pp * 2 + ep: the two EP ranks of a pipeline position hold disjoint halves of the 16 experts
    for pp in range(2):
        (_, a), (_, b) = got[2 * pp], got[2 * pp + 1]
        assert a and b and not set(a) & set(b) and len(a) == len(b)


@pytest.mark.slow
def test_pp2_dp2_ep2_one_step_equals_single_process():
    """DeepSeek-V3's layout in miniature: 8 processes, DualPipe x dp 2 x ep 2 with ZeRO-1 (expert gradients
    summed over the 2 dp replicas only, dense ones over all 4)."""
    per_rank = run_ranks(_suite, 8, 2, 2, 2, [("dualpipe", "zero1", 4)], timeout=600)
    for checked, _ in _check(per_rank, "dualpipe"):
        assert checked["expert"] > 0 and checked["dense"] > 0
