"""DeepSeek-V3 integration over several CPU processes (gloo): expert parallelism and pipelines.

Every worker builds the same seeded full model, runs the single-process reference itself, then
its own part of the parallel run, and asserts equality there (an assertion error comes back
with the rank's traceback).
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.models.deepseek_v3 import (
    DeepSeekV3Config,
    DeepSeekV3Model,
    criterion_for,
    stages_for_rank,
    sync_replicas,
)
from mt_dualpipe.models.deepseek_v3.moe import moe_block
from tests.helpers.deepseek import overlapped_equals_sequential
from tests.helpers.dist import run_ranks
from tests.helpers.fb_units import fb_unit_counter

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=4, vocab_size=128, inter_dim=128, moe_inter_dim=32, max_seq_len=64)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


def make_batch(config, batch, seq, seed):
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


# ----- expert parallelism ------------------------------------------------------------------------------------
def _ep_worker(rank, world, savers=""):
    config = small_config(balance_loss_weight=0.0, memory_savers=savers)
    torch.manual_seed(0)
    full = DeepSeekV3Model(config).model.layers["1"].mlp
    shard = moe_block(config, ep_group=dist.group.WORLD)
    shard.load_state_dict({k: v for k, v in full.state_dict().items() if k in shard.state_dict()})
    assert len(shard.experts) == config.n_routed_experts // world
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * world, 16, config.dim, generator=g)
    dy = torch.randn(x.shape, generator=g)
    rows = slice(2 * rank, 2 * rank + 2)
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.backward(dy)
    x_loc = x[rows].clone().requires_grad_()
    y = shard(x_loc)
    y.backward(dy[rows])
    torch.testing.assert_close(y, y_ref[rows], rtol=0, atol=0)  # combine == ep=1, bit for bit
    if savers:  # the combine saver's gate weights travelled with the rows (and their gradient back)
        assert shard.weight_before_down and next(iter(shard.experts.values())).recompute_product
    torch.testing.assert_close(x_loc.grad, x_ref.grad[rows], rtol=1e-6, atol=1e-7)
    for name, p in shard.named_parameters():
        if name.startswith("experts."):  # each expert lives on one rank and saw every rank's tokens
            torch.testing.assert_close(p.grad, full.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
        else:  # replicated: the ranks' partial gradients sum to the full one
            dist.all_reduce(p.grad)
            torch.testing.assert_close(p.grad, full.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    # the routed-token counts, summed over the EP ranks, equal the single process's
    load = shard.gate.load.clone()
    dist.all_reduce(load)
    assert torch.equal(load, full.gate.load)
    return len(shard.experts)


def test_expert_parallel_dispatch_combine_equals_ep1(two_ranks):
    assert two_ranks("ep") == [8, 8]


def _ep_overlap_worker(rank, world, savers=""):
    """With ep=2 the overlapped F&B posts real non-blocking all-to-alls; still bit-identical."""
    config = small_config(n_layers=2, memory_savers=savers)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    x0, _ = make_batch(config, 2, 16, seed=10 + rank)
    x1, y1 = make_batch(config, 2, 16, seed=20 + rank)
    return overlapped_equals_sequential(config, model, x0, x1, y1)


def test_overlapped_forward_backward_with_expert_parallel_all_to_all(two_ranks):
    assert two_ranks("ep_overlap") == [True, True]


# ----- pipelines equal the single-process model ------------------------------------------------------------------
def _pipeline_worker(rank, world, schedule, num_mb, layout, savers=""):
    from mt_dualpipe import DualPipe, DualPipeV
    from mt_dualpipe.schedules.registry import build_schedule

    config = small_config(memory_savers=savers)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    data = [make_batch(config, 1, 16, seed=100 + m) for m in range(num_mb)]
    ref_losses = []
    for x, y in data:  # the reference: each micro-batch's loss backpropagated as is, gradients summed
        loss = model(x, y)
        loss.backward()
        ref_losses.append(loss.detach())
    sched = build_schedule(schedule, world, num_mb)
    mods = stages_for_rank(config, sched, rank, layout, source=model)
    # a rank holding the first stage and the last (MTP) has one embedding: one Parameter for both uses, whose
    # gradient (checked below against the single model's) is the sum of the two; elsewhere copies, tied
    holders = [m for m in mods if hasattr(m.model, "embed_tokens")]
    shared = len(holders) == 2 and holders[0].model.embed_tokens is holders[1].model.embed_tokens
    assert shared or len(holders) < 2
    pipe = (DualPipe if schedule == "dualpipe" else DualPipeV)(tuple(mods), timeout=60)
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    inputs = [torch.cat([data[m][0] for m in sched.microbatches_of(first[0])])] if first else []
    labels = (torch.cat([data[m][1] for m in sched.microbatches_of(last[0])]),) if last else ()
    with fb_unit_counter() as calls:  # the F&B units the step runs
        loss, _ = pipe.step(*inputs, num_chunks=num_mb, criterion=criterion_for(mods), labels=labels)
    if last:
        expected = torch.stack([ref_losses[m] for m in sched.microbatches_of(last[0])])
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    # no gradient sync: the step summed the mirrored copies and the MTP embedding copy (tied_parameters)
    sync_replicas(mods, dist.group.WORLD, what="load")
    checked = 0
    for mod in mods:
        for name, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
            checked += 1
        for name, b in mod.named_buffers():
            if name.endswith("gate.load"):
                assert torch.equal(b, model.get_buffer(name)), name
    loads = [b.clone() for m in mods for n, b in m.named_buffers() if n.endswith("gate.load")]
    with torch.no_grad():  # an inference step: forward only, the same losses, no routing counts
        loss_inf, _ = pipe.step(*inputs, num_chunks=num_mb, criterion=criterion_for(mods), labels=labels)
    if last:
        torch.testing.assert_close(loss_inf, expected, rtol=1e-6, atol=1e-6)
    after = [b for m in mods for n, b in m.named_buffers() if n.endswith("gate.load")]
    assert all(torch.equal(a, b) for a, b in zip(loads, after))
    return checked, len(calls), shared


def test_dualpipe_2_ranks_matches_single_process(two_ranks):
    res = two_ranks("dualpipe")
    assert all(c > 20 for c, _, _ in res)
    assert sum(fb for _, fb, _ in res) > 0  # the overlapped F&B path ran
    assert [shared for _, _, shared in res] == [True, True]  # each rank holds stages 0 and 1 (DualPipe's mirror)


def test_dualpipe_4_ranks_matches_single_process():
    res = run_ranks(_pipeline_worker, 4, "dualpipe", 8, [1, 1, 1, 1], timeout=180)
    assert all(c > 20 for c, _, _ in res)
    assert all(fb > 0 for _, fb, _ in res)
    assert [shared for _, _, shared in res] == [True, False, False, True]  # ranks 0 and 3 hold stages 0 and 3


def test_dualpipev_matches_single_process(two_ranks):
    res = two_ranks("dualpipev")
    assert all(c > 20 for c, _, _ in res)
    assert [shared for _, _, shared in res] == [True, False]  # rank 0 holds stages 0 and 3


def _zero_bubble_worker(rank, world, schedule, num_mb, savers=""):
    """Zero-bubble schedules split B and W for real: the stages' DeferredLinears queue their GEMMs for W."""
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime import DeferredLinear
    from mt_dualpipe.runtime.stage import supports_fast_split
    from mt_dualpipe.schedules.registry import build_schedule

    config = small_config(memory_savers=savers)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    data = [make_batch(config, 1, 16, seed=300 + m) for m in range(num_mb)]
    ref_losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        ref_losses.append(loss.detach())
    sched = build_schedule(schedule, world, num_mb)
    mods = stages_for_rank(config, sched, rank, source=model)
    assert all(supports_fast_split(m) for m in mods)
    assert not any(type(m) is torch.nn.Linear for mod in mods for m in mod.modules())
    linears = sum(type(m) is DeferredLinear for mod in mods for m in mod.modules())
    pipe = Pipeline(mods, sched, timeout=60, fuse_backward=False)  # every backward of the schedule split
    calls = []  # every linear call of the training step leaves one weight-gradient GEMM
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for mod in mods for m in mod.modules() if type(m) is DeferredLinear]
    first = any(ranks[0] == rank for ranks in sched.placement)
    last = any(ranks[-1] == rank for ranks in sched.placement)
    loss, _ = pipe.step(*([torch.cat([x for x, _ in data])] if first else []), num_chunks=num_mb,
                        criterion=criterion_for(mods), labels=(torch.cat([y for _, y in data]),) if last else ())
    for h in hooks:
        h.remove()
    if last:
        torch.testing.assert_close(loss, torch.stack(ref_losses), rtol=1e-6, atol=1e-6)
    for mod in mods:  # the step summed the MTP embedding's copies (tied_parameters)
        for name, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    return pipe.store.closures_run, len(calls), linears


def test_zero_bubble_runs_deferred_weight_gradients_at_w(two_ranks):
    for closures, calls, linears in two_ranks("zb-h1"):
        # zb-h1 splits every backward: each linear call's weight-gradient GEMM was queued at B and run at W
        assert linears > 10 and calls >= 4 * 4 and closures == calls, (closures, calls, linears)


def test_memory_savers_keep_every_parallel_path_equal_to_single_process(two_ranks):
    """All of DeepSeek's memory savers on: expert parallelism (the gate weights and their gradients cross the
    all-to-all), the overlapped F&B over real all-to-alls, DualPipe and the zero-bubble B/W split."""
    assert two_ranks("ep_savers") == [8, 8]
    assert two_ranks("ep_overlap_savers") == [True, True]
    res = two_ranks("dualpipe_savers")
    assert all(c > 20 for c, _, _ in res) and sum(fb for _, fb, _ in res) > 0
    for closures, calls, linears in two_ranks("zb-h1_savers"):
        assert linears > 10 and calls >= 4 * 4 and closures == calls, (closures, calls, linears)


# ----- the 2-rank checks share one set of processes (spawning is most of their cost) --------------------------
_TWO_RANK_PARTS = {
    "ep": (_ep_worker, ()),
    "ep_overlap": (_ep_overlap_worker, ()),
    "dualpipe": (_pipeline_worker, ("dualpipe", 4, [2, 2])),
    "dualpipev": (_pipeline_worker, ("dualpipev", 4, [1, 1, 1, 1])),
    "zb-h1": (_zero_bubble_worker, ("zb-h1", 4)),
    "ep_savers": (_ep_worker, ("all",)),
    "ep_overlap_savers": (_ep_overlap_worker, ("all",)),
    "dualpipe_savers": (_pipeline_worker, ("dualpipe", 4, [2, 2], "all")),
    "zb-h1_savers": (_zero_bubble_worker, ("zb-h1", 4, "all")),
}


def _two_rank_suite(rank, world):
    out = {}
    for name, (fn, args) in _TWO_RANK_PARTS.items():
        try:
            out[name] = (None, fn(rank, world, *args))
        except BaseException:
            out[name] = (traceback.format_exc(), None)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    per_rank = run_ranks(_two_rank_suite, 2, timeout=180)

    def part(name):
        errors = [f"rank {r}:\n{res[name][0]}" for r, res in enumerate(per_rank) if res[name][0] is not None]
        if errors:
            raise AssertionError("\n".join(errors))
        return [res[name][1] for res in per_rank]

    return part


# ----- the step's valid-target counts --------------------------------------------------------------------------
def _normalized_worker(rank, world, x, y):
    from mt_dualpipe import DualPipeV
    from mt_dualpipe.models.deepseek_v3 import step_normalizers
    from mt_dualpipe.schedules.registry import build_schedule

    config = small_config(balance_loss_weight=0.0)  # the sequence-wise balance loss is a per-micro-batch mean
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    sched = build_schedule("dualpipev", world, 4)
    mods = stages_for_rank(config, sched, rank, source=model)
    pipe = DualPipeV(tuple(mods), timeout=60)
    crit = criterion_for(mods, normalizer=step_normalizers(y, config.mtp_depth))  # every rank holds the batch here
    pipe.step(*([x] if rank == 0 else []), num_chunks=4, criterion=crit, labels=(y,) if rank == 0 else ())
    return {n: p.grad.clone() for m in mods for n, p in m.named_parameters() if p.grad is not None}


def test_step_normalizers_make_pipelined_gradients_equal_the_whole_batch_token_means():
    """Micro-batches with 0, 5, 10 and 15 ignored targets: with ``step_normalizers`` (main loss and each MTP
    depth over its own valid targets) DualPipeV's gradients equal one process's token means over the
    whole batch; summing per-micro-batch means (the default) does not."""
    config = small_config(balance_loss_weight=0.0)
    x, y = make_batch(config, 8, 16, seed=77)
    y = y.clone()
    for m, part in enumerate(torch.tensor_split(y, 4)):
        part.view(-1)[: 5 * m] = -100
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    model(x, y).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        model(xm, ym).backward()
    per_micro_batch = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got: dict = {}
    for grads in run_ranks(_normalized_worker, 2, x, y, timeout=120):
        for n, g in grads.items():
            got[n] = got[n] + g if n in got else g
    assert sorted(got) == sorted(want)
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    assert max(float((per_micro_batch[n] - want[n]).abs().max() / want[n].abs().max()) for n in want) > 1e-2
