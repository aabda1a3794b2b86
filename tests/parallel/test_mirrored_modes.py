"""zero1 and fsdp on DualPipe's placements at PP2 x DP2 (4 gloo ranks): equal to allreduce mode.

DualPipe holds every stage twice (pipeline ranks r and P-1-r run the same layers in the two
chains): each data-parallel mode must sum the two copies' gradients once and average the
replicas. DualPipeV holds each stage once (a V). For both, after three AdamW steps in fp64 the
zero1 and fsdp parameters must equal allreduce mode's, which must equal the single-process model
over the same global batches (``tests.helpers.parallel.reference``). The optimizer state per rank
must drop by the size of the group the state is sharded over: dp for a stage held once, copies x
dp for a mirrored stage (its ZeRO group spans both copies).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mt_dualpipe.parallel import FSDPStageSync, init_parallel
from mt_dualpipe.runtime import DualPipe, DualPipeV, defer_weight_grads
from mt_dualpipe.schedules.registry import schedule_info
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import adamw, global_batch, local_loss, make_model, reference

DP, M, STEPS = 2, 4, 3
MODES = ("allreduce", "zero1", "fsdp")


def _local_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Optimizer state bytes held here (a DTensor's local shard only)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, DTensor):
                v = v.to_local()
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _run(name: str, mode: str) -> tuple[list[list[torch.Tensor]], int]:
    """Three AdamW steps of ``name`` in ``mode``: full parameters per local stage, optimizer state bytes."""
    dims = init_parallel(pp=2, dp=DP)
    pp = dims.coord("pp")
    placement = schedule_info(name).layout(2, M).ranks
    model = defer_weight_grads(make_model(blocks=max(len(c) for c in placement)))
    local = [(c, s) for c, chain in enumerate(placement) for s, r in enumerate(chain) if r == pp]
    modules = [model[s] for _, s in local]
    if mode == "fsdp":
        modules = [fully_shard(m, mesh=dims.submesh("dp")) for m in modules]
        with pytest.raises(ValueError, match=r"must contain the shard mesh's ranks \[\d, \d\] and be a multiple"):
            FSDPStageSync(modules[0], group=dims.group("pp"))  # the copies' group without the replicas: refused
    cls = DualPipe if name == "dualpipe" else DualPipeV
    pipe = cls(tuple(modules), mesh=dims, dp_mode=mode)
    opt = pipe.build_optimizer(adamw)  # one object for both local stages, every mode
    rows = global_batch(1)[0].shape[0] // DP
    for step in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(1 + step)
        if name == "dualpipe":  # each end feeds half of the global batch; the other end holds its labels
            xs, ys = x.chunk(2), y.chunk(2)
            inputs, labels = (xs[pp],), (ys[1 - pp],)
        else:  # DualPipeV: rank 0 holds the V's first and last stage
            inputs, labels = ((x,), (y,)) if pp == 0 else ((), ())
        pipe.step(*inputs, num_chunks=M, criterion=lambda out, t: local_loss(out, t, rows), labels=labels)
        opt.step()
    params = [[(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in m.parameters()]
              for m in pipe.module]
    state = opt.state_bytes() if mode != "fsdp" else sum(_local_state_bytes(o) for o in opt.optimizers)
    return params, state


def _worker(rank: int, world: int, name: str) -> dict:
    placement = schedule_info(name).layout(2, M).ranks
    ref = reference(STEPS, "adamw", blocks=max(len(c) for c in placement))
    pp = rank // DP  # pp outermost
    local = [s for chain in placement for s, r in enumerate(chain) if r == pp]
    out = {"local": local}
    for mode in MODES:
        params, state = _run(name, mode)
        out[mode] = {"params": params, "state": state,
                     "ref_diff": max((a - b).abs().max().item() for s, ps in zip(local, params)
                                     for a, b in zip(ps, ref[s].parameters()))}
    return out


@pytest.mark.parametrize("name", ["dualpipe", pytest.param("dualpipev", marks=pytest.mark.slow)])  # V: no mirror
def test_zero1_and_fsdp_equal_allreduce_on_dualpipe_placements(name: str) -> None:
    out = run_ranks(_worker, 4, name, timeout=240)
    copies = len(schedule_info(name).layout(2, M).ranks) if name == "dualpipe" else 1
    for rank, o in enumerate(out):
        assert o["allreduce"]["ref_diff"] < 1e-10, (rank, o["allreduce"]["ref_diff"])
        for mode in ("zero1", "fsdp"):
            diff = max((a - b).abs().max().item() for pa, pb in zip(o[mode]["params"], o["allreduce"]["params"])
                       for a, b in zip(pa, pb))
            assert diff < 1e-12, (name, mode, rank, diff)
        full = o["allreduce"]["state"]
        # zero1 shards over the stage's sync group (copies x dp); fsdp's optimizer sees FSDP's dp shards
        assert abs(o["zero1"]["state"] / full - 1 / (copies * DP)) < 0.05, (rank, o["zero1"]["state"], full)
        assert abs(o["fsdp"]["state"] / full - 1 / DP) < 0.05, (rank, o["fsdp"]["state"], full)
