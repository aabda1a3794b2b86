"""Runtime behaviour beyond plain correctness: shapes learned per step and re-negotiated when the
inputs change, uneven micro-batches, messages of several tensors of different shapes and dtypes
(an integer one passed through without a gradient), measured timelines, clear errors for a
non-tensor stage output and for a shape that changes within a step, and the timeout error when
a peer hangs."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe.runtime.errors import PipelineError
from mt_dualpipe.runtime.stage import Stage
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from mt_dualpipe.schedules import build_schedule
from mt_dualpipe.schedules.fuse import executed_schedule
from tests.helpers.dist import run_ranks
from tests.helpers.models import H, cos_diff


class Multi(nn.Module):
    """Takes and returns (float64 activations, int64 ids, float32 side tensor of another shape)."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.lin = nn.Linear(H, H).double()
        self.proj = nn.Linear(3, 3)

    def forward(self, x, ids, aux):
        side = self.proj(aux)
        h = torch.tanh(self.lin(x)) + 0.01 * ids.unsqueeze(-1).double() + side.double().sum(-1, keepdim=True)
        if self.last:
            return h + side.double().mean()
        return h, ids, side * 0.5


def multi_model(n: int) -> list[nn.Module]:
    torch.manual_seed(3)
    return [Multi(i == n - 1) for i in range(n)]


def multi_data(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64), torch.randint(0, 5, (rows,), generator=g),
            torch.randn(rows, 3, generator=g), torch.randn(rows, H, generator=g, dtype=torch.float64))


def multi_reference(layers, x, ids, aux, target, m):
    layers = copy.deepcopy(layers)
    losses = []
    for xm, im, am, tm in zip(*(torch.tensor_split(t, m) for t in (x, ids, aux, target))):
        h = (xm, im, am)
        for layer in layers:
            h = layer(*h)
        loss = F.mse_loss(h, tm)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), [[p.grad.clone() for p in layer.parameters()] for layer in layers]


def _criterion(out, target):
    return F.mse_loss(out, target)


class Flip(nn.Module):
    """Returns a wider output once ``wide`` is set: a shape change without an input change."""

    wide = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H).double()

    def forward(self, x):
        y = self.lin(x)
        return torch.cat([y, y], -1) if Flip.wide else y


class Head(nn.Module):
    def forward(self, x):
        return x[..., :H]


class Keeper(nn.Module):
    """Keeps every output it returns, to check which ones the runtime released after sending."""

    def __init__(self, squash: bool):
        super().__init__()
        self.lin = nn.Linear(H, H).double()
        self.squash = squash
        self.kept = []

    def forward(self, x):
        y = self.lin(x)
        y = torch.sigmoid(y) if self.squash else y  # sigmoid's backward needs its output: must stay
        self.kept.append(y)
        return y


def _released_outputs(rank, world):
    from mt_dualpipe import Pipeline

    sched = build_schedule("zbv", world, 4)
    torch.manual_seed(7)
    layers = [Keeper(squash=(s == 0)) for s in range(4)]
    mods = [copy.deepcopy(layers[s]) for _, s in sched.local_stages(rank)]
    pipe = Pipeline(mods, sched, timeout=20)
    x, target = torch.randn(8, H, dtype=torch.float64), torch.randn(8, H, dtype=torch.float64)
    loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=_criterion,
                        labels=(target,) if rank == 0 else ())
    ok = True
    if rank == 0:
        ref = []
        for xm, tm in zip(x.chunk(4), target.chunk(4)):
            h = xm
            for layer in layers:
                h = layer(h)
            ref.append(_criterion(h, tm).detach())
        ok = torch.equal(loss, torch.stack(ref))
    return ok, {s: [t.untyped_storage().nbytes() == 0 for t in m.kept]
                for (_, s), m in zip(sched.local_stages(rank), mods)}


def _mapped(rank, world):
    """rank_mapping=[1, 0]: process 0 runs pipeline rank 1 (the last stage) and process 1 the first."""
    from mt_dualpipe import Pipeline

    torch.manual_seed(11)
    layers = [nn.Linear(H, H).double() for _ in range(world)]
    pp_rank = world - 1 - rank
    pipe = Pipeline([copy.deepcopy(layers[pp_rank])], "1f1b", rank_mapping=list(reversed(range(world))), timeout=20)
    x, target = torch.randn(6, H, dtype=torch.float64), torch.randn(6, H, dtype=torch.float64)
    loss, _ = pipe.step(*((x,) if pp_rank == 0 else ()), num_chunks=3, criterion=_criterion,
                        labels=(target,) if pp_rank == world - 1 else ())
    if pp_rank != world - 1:
        return pipe.rank, loss is None
    ref = []
    for xm, tm in zip(x.chunk(3), target.chunk(3)):
        h = xm
        for layer in layers:
            h = layer(h)
        ref.append(_criterion(h, tm).detach())
    return pipe.rank, torch.equal(loss, torch.stack(ref))


def _behaviour_worker(rank, world, sched_name, m):
    from mt_dualpipe import Pipeline

    out = {}
    sched = build_schedule(sched_name, world, m)
    layers = multi_model(len(sched.placement[0]))
    mods = [copy.deepcopy(layers[s]) for _, s in sched.local_stages(rank)]
    pipe = Pipeline(mods, sched, timeout=20, allow_uneven=True)  # the 2m+3-row step splits unevenly
    pipe.record_timeline = True
    first, last = sched.placement[0][0] == rank, sched.placement[0][-1] == rank
    steps = []
    for rows, seed in ((2 * m, 0), (3 * m, 1), (2 * m + 3, 2), (2 * m, 3)):  # shapes change; uneven split; back
        x, ids, aux, target = multi_data(rows, seed)
        for p in pipe.parameters():
            p.grad = None
        loss, _ = pipe.step(*((x, ids, aux) if first else ()), num_chunks=m, criterion=_criterion,
                            labels=(target,) if last else ())
        ref_loss, ref_grads = multi_reference(layers, x, ids, aux, target, m)
        grads = [[p.grad for p in mod.parameters()] for mod in mods]
        diff = max(cos_diff(g, ref_grads[s][i]) for (_, s), gs in zip(sched.local_stages(rank), grads)
                   for i, g in enumerate(gs))
        steps.append({"loss_ok": torch.equal(loss, ref_loss) if last else loss is None, "grad_diff": diff,
                      "cached": len(pipe.p2p.cache)})
    out["steps"] = steps
    out["timeline"] = pipe.timeline
    out["released"] = _released_outputs(rank, world)
    out["mapped"] = _mapped(rank, world)
    # a stage output that changes shape within a step (same inputs, so no re-negotiation): clear error
    pipe2 = Pipeline([Flip() if rank == 0 else Head()], build_schedule("1f1b", world, 2), timeout=10)
    x = torch.randn(4, H, dtype=torch.float64)
    target = torch.randn(4, H, dtype=torch.float64)
    pipe2.step(*((x,) if rank == 0 else ()), num_chunks=2, criterion=_criterion,
               labels=(target,) if rank == world - 1 else ())
    Flip.wide = True
    try:
        pipe2.step(*((x,) if rank == 0 else ()), num_chunks=2, criterion=_criterion,
                   labels=(target,) if rank == world - 1 else ())
        out["mismatch"] = None
    except PipelineError as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def behaviour():
    return run_ranks(_behaviour_worker, 2, "zbv", 4, timeout=120)


def test_shapes_learned_renegotiated_and_uneven(behaviour):
    for rank, res in enumerate(behaviour):
        for i, st in enumerate(res["steps"]):
            assert st["loss_ok"], (rank, i)
            assert st["grad_diff"] < 1e-12, (rank, i, st["grad_diff"])
            assert st["cached"] > 0


def test_multi_tensor_messages_cache_every_message(behaviour):
    # zbv on 2 ranks: 4 stages, 2 cross-rank hops each way per micro-batch, 4 micro-batches
    for res in behaviour:
        assert res["steps"][0]["cached"] == 2 * 2 * 4


def test_measured_timeline_gathered_on_rank_0(behaviour):
    tl = behaviour[0]["timeline"]
    assert behaviour[1]["timeline"] is None
    sched = build_schedule("zbv", 2, 4)
    executed = executed_schedule(sched)  # what ran: a B directly followed by its own W as one BW
    assert tl.source == "measured" and tl.name == "zbv"
    assert executed.ranks != sched.ranks and sum(map(len, executed.ranks)) < sum(map(len, sched.ranks))
    for r in range(2):
        evs = [e for e in tl.events if e.rank == r]
        assert [e.op for e in evs] == [i.kind for i in executed.ranks[r]]
        assert all(a.end <= b.start for a, b in zip(evs, evs[1:]))
    assert min(e.start for e in tl.events) == 0.0


def test_sent_outputs_are_released_unless_their_backward_needs_them(behaviour):
    ok0, rank0 = behaviour[0]["released"]
    ok1, rank1 = behaviour[1]["released"]
    assert ok0 and ok1
    assert rank0[0] == [False] * 4  # stage 0 ends in sigmoid (its backward uses the output): kept
    assert rank0[3] == [False] * 4  # stage 3 ends the chain: nothing sent
    assert rank1[1] == [False] * 4  # stage 1 hands its output to stage 2 on the same rank: nothing sent
    assert rank1[2] == [True] * 4  # stage 2's linear output, sent back to rank 0: released


def test_rank_mapping(behaviour):
    assert [res["mapped"] for res in behaviour] == [(1, True), (0, True)]


def test_shape_change_within_a_step_is_a_clear_error(behaviour):
    kind, msg = behaviour[0]["mismatch"]
    assert kind == "PipelineError"
    assert "rank 0" in msg and "SEND_F" in msg and "expects" in msg and "(2, 16)" in msg and "(2, 8)" in msg
    kind1, msg1 = behaviour[1]["mismatch"]
    assert kind1 == "PipelinePeerError" and msg1.startswith("rank 1: rank 0 failed") and "SEND_F" in msg1


def test_non_tensor_stage_output_is_a_clear_error():
    class Bad(nn.Module):
        def forward(self, x):
            return {"y": x}

    st = Stage(Bad(), 0, 0, True, False, WeightGradStore())
    with pytest.raises(PipelineError, match=r"returned a dict; a stage must return a Tensor or a non-empty tuple"):
        st.forward(0, (torch.ones(2),), None, (), True, False)


class Sleepy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H).double()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            time.sleep(6)  # hangs longer than the pipeline's timeout
        return self.lin(x)


def _hung_worker(rank, world):
    from mt_dualpipe import Pipeline

    torch.manual_seed(0)
    mod = Sleepy() if rank == 1 else nn.Linear(H, H).double()
    pipe = Pipeline([mod], "1f1b", timeout=2)
    x = torch.randn(6, H, dtype=torch.float64)
    try:
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=3, criterion=_criterion,
                  labels=(x,) if rank == world - 1 else ())
    except PipelineError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_hung_peer_gives_timeout_error_on_its_peers():
    res = run_ranks(_hung_worker, 3, timeout=60)
    for rank in (0, 2):
        kind, msg = res[rank]
        assert kind == "PipelineTimeoutError"
        assert f"rank {rank}: instruction " in msg and "peer rank 1" in msg and "more than 2s" in msg
    assert "RECV_B" in res[0][1] and "RECV_F" in res[2][1]
    # the hung rank fails too once it wakes: its peers have given up
    assert res[1] is not None and res[1][0] in ("PipelineTimeoutError", "PipelineCommError")
    assert "rank 1: instruction " in res[1][1]
