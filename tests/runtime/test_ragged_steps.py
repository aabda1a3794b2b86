"""Ragged micro-batches: ``Pipeline.step`` takes a list with one tensor per micro-batch, shapes differing.

A tiny float64 Llama runs two ragged steps (sequence lengths 16, 32, 24, 8, then 8, 40, 16, 24: the
second step relearns every message shape) on 2 gloo ranks under 1F1B, ZB-V, DualPipeV, interleaved
1F1B, the ``DualPipe`` class and a 1F1B whose ``microbatch_order`` runs them out of the caller's
order (the first stage sees them in that order); the losses (in the caller's order) and the
gradients equal one process running each micro-batch alone within 1e-12. One case each on a PP2 x
DP2 mesh (every replica takes its rows of every micro-batch, losses normalised by the step's
valid-token count) and under ``Rewind`` (a NaN on one rank rewinds, and the run ends with the
parameters of a clean run that skipped the batch). The mistakes fail on every rank at the step's
start, each with one clear message.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn as nn

from tests.helpers.dist import run_ranks

LENGTHS = ((16, 32, 24, 8), (8, 40, 16, 24))  # two steps of four micro-batches, ROWS sequences each
ROWS = 2
SCHEDULES = ("1f1b", "zbv", "dualpipev", "interleaved-1f1b", "DualPipe", "1f1b+order")
ORDER = (2, 0, 3, 1)  # "1f1b+order": slot m of the ops runs the caller's micro-batch ORDER[m]


def _config():
    from mt_dualpipe.models.llama import LlamaConfig

    return LlamaConfig.preset("tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=4)


def _model():
    from mt_dualpipe.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).double()


def _tokens(step: int, rows: int = ROWS, masked: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) of each micro-batch of ``step``; ``masked``: micro-batch m ignores 3m targets."""
    g = torch.Generator().manual_seed(10 + step)
    out = []
    for m, n in enumerate(LENGTHS[step % 2]):
        t = torch.randint(0, 64, (rows, n + 1), generator=g)
        x, y = t[:, :-1], t[:, 1:].clone()
        if masked:
            y.view(-1)[: 3 * m] = -100
        out.append((x, y))
    return out


def _grads(modules) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for m in modules for n, p in m.named_parameters() if p.grad is not None}


# ----- every schedule on 2 ranks against one process -------------------------------------------
def _run_schedule(rank: int, name: str) -> dict:
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.models.llama import criterion_for, stages_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    sched = build_schedule({"DualPipe": "dualpipe", "1f1b+order": "1f1b"}.get(name, name), 2, 4)
    if name == "1f1b+order":
        sched = dataclasses.replace(sched, microbatch_order=ORDER)
    mods = [m.double() for m in stages_for_rank(_config(), sched, rank, source=_model())]
    if name == "DualPipe":
        pipe = DualPipe((mods[0], mods[1]), timeout=60)
    else:
        pipe = Pipeline(mods, sched if name == "1f1b+order" else name, timeout=60)
    fed: list[int] = []  # the sequence length of each micro-batch the first stage runs, in running order
    mods[0].register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[1]) if rank == 0 else None)
    crit = criterion_for(mods)
    losses, shapes = [], []
    for step in range(2):
        data = _tokens(step)
        if name == "DualPipe":  # rank r feeds chain r (micro-batches 2r, 2r+1) and ends the other chain
            mine, theirs = data[2 * rank: 2 * rank + 2], data[2 - 2 * rank: 4 - 2 * rank]
            inputs, labels = [x for x, _ in mine], [y for _, y in theirs]
        else:
            inputs = [x for x, _ in data] if pipe.needs_inputs else None
            labels = [y for _, y in data] if pipe.needs_labels else None
        loss, out = pipe.step(*([inputs] if inputs else []), num_chunks=4, criterion=crit,
                              labels=(labels,) if labels else (), return_outputs=True)
        if loss is not None:
            losses.append(loss.tolist())
            shapes.append([tuple(o.shape) for o in out] if isinstance(out, list) else type(out).__name__)
    if name == "DualPipe":
        pipe.sync_mirrored_grads()
    return {"losses": losses, "shapes": shapes, "grads": _grads(mods), "fed": fed}


def _every_schedule(rank: int, world: int) -> dict:
    return {name: _run_schedule(rank, name) for name in SCHEDULES}


@pytest.fixture(scope="module")
def reference():
    """Each micro-batch of both steps alone on one process: its loss, and the gradients of their sum."""
    model = _model()
    losses = []
    for step in range(2):
        per_mb = [model(x, y) for x, y in _tokens(step)]
        torch.stack(per_mb).sum().backward()
        losses.append([float(v.detach()) for v in per_mb])
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def schedules() -> list[dict]:
    return run_ranks(_every_schedule, 2, timeout=300)


def _same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got and set(got) <= set(want)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-12, atol=1e-13, msg=n)


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
@pytest.mark.parametrize("name", SCHEDULES)
def test_ragged_steps_equal_one_process_per_micro_batch(schedules, reference, name):
    want_losses, want_grads = reference
    got = [schedules[r][name] for r in range(2)]
    held = set()
    for out in got:
        _same_grads(out["grads"], want_grads)
        held |= set(out["grads"])
    assert held == set(want_grads)  # the two ranks together hold every parameter
    if name == "DualPipe":  # rank 0 ends chain 1 (micro-batches 2, 3), rank 1 chain 0 (0, 1)
        for r, lo in ((0, 2), (1, 0)):
            for step in range(2):
                assert got[r]["losses"][step] == pytest.approx(want_losses[step][lo: lo + 2], rel=1e-12, abs=0)
                assert got[r]["shapes"][step] == [(ROWS, n, 32) for n in LENGTHS[step][lo: lo + 2]]
        return
    loss_rank = 1 if name in ("1f1b", "interleaved-1f1b", "1f1b+order") else 0  # a V ends on rank 0
    running = [[LENGTHS[step][m] for m in (ORDER if name == "1f1b+order" else range(4))] for step in range(2)]
    assert got[0]["fed"] == running[0] + running[1]  # the schedule's order, the losses still in the caller's
    assert got[1 - loss_rank]["losses"] == []
    for step in range(2):
        assert got[loss_rank]["losses"][step] == pytest.approx(want_losses[step], rel=1e-12, abs=0)
        assert got[loss_rank]["shapes"][step] == [(ROWS, n, 32) for n in LENGTHS[step]]  # a list, caller's order


# ----- a PP2 x DP2 mesh: each replica takes its rows of every micro-batch ------------------------
def _mesh(rank: int, world: int) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.layers import step_normalizer
    from mt_dualpipe.models.llama import criterion_for, stages_for_rank
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.schedules.registry import build_schedule

    dims = init_parallel(pp=2, dp=2)
    pp = dims.coord("pp")
    mods = [m.double() for m in stages_for_rank(_config(), build_schedule("1f1b", 2, 4), pp, source=_model())]
    pipe = Pipeline(mods, "1f1b", mesh=dims, timeout=60)
    data = _tokens(0, rows=4, masked=True)
    labels = [y for _, y in data]
    # the global batch's valid targets over the dp replicas that average the gradients
    crit = criterion_for(mods, normalizer=step_normalizer(torch.cat([y.reshape(-1) for y in labels]), replicas=2))
    loss, _ = pipe.step(*([[x for x, _ in data]] if pp == 0 else []), num_chunks=4, criterion=crit,
                        labels=(labels,) if pp == 1 else ())
    return {"grads": _grads(mods), "loss": None if loss is None else loss.tolist()}


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
def test_ragged_steps_on_a_mesh_equal_the_global_token_mean():
    data = _tokens(0, rows=4, masked=True)
    total = sum(int((y != -100).sum()) for _, y in data)
    model = _model()
    sums = [model(x, y) * int((y != -100).sum()) for x, y in data]  # each micro-batch alone, its target sum
    (torch.stack(sums).sum() / total).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = run_ranks(_mesh, 4, timeout=240)
    for r in out:
        _same_grads(r["grads"], want)  # the replicas' average
    assert set(out[0]["grads"]) | set(out[2]["grads"]) == set(want)  # pp outermost: ranks 0, 1 hold stage 0
    assert [r["loss"] is None for r in out] == [True, True, False, False] and len(out[2]["loss"]) == 4


# ----- Rewind: a NaN on one rank during a ragged run ----------------------------------------------
NAN_STEP = 1


def _rewind(rank: int, world: int) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.llama import criterion_for, stages_for_rank
    from mt_dualpipe.resilience import FaultInjector, Rewind
    from mt_dualpipe.schedules.registry import build_schedule

    def build():
        mods = [m.double() for m in stages_for_rank(_config(), build_schedule("zbv", 2, 4), rank, source=_model())]
        pipe = Pipeline(mods, "zbv", timeout=30)
        return mods, pipe, torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)

    def batch(pos: int) -> dict:  # zbv: inputs and labels on rank 0
        data = _tokens(pos)
        return {"inputs": ([x for x, _ in data],), "labels": ([y for _, y in data],)} if rank == 0 else {}

    mods, pipe, opt = build()
    faults = FaultInjector(rank=rank)
    faults.nan(rank=1, step=NAN_STEP, op="forward")
    rw = Rewind(pipe, opt, num_chunks=4, criterion=criterion_for(mods), snapshot_every=1, faults=faults)
    rw.run(batch, 3)
    clean_mods, clean_pipe, clean_opt = build()
    for pos in (p for p in range(4) if p not in rw.skipped):
        clean_opt.zero_grad()
        b = batch(pos)
        clean_pipe.step(*b.get("inputs", ()), num_chunks=4, criterion=criterion_for(clean_mods),
                        labels=b.get("labels", ()))
        clean_opt.step()
    same = all(torch.equal(a, b) for m, c in zip(mods, clean_mods) for a, b in zip(m.parameters(), c.parameters()))
    return {"skipped": sorted(rw.skipped), "same": same, "faults": [(e.step, int(e.kind)) for e in rw.events]}


def test_rewind_skips_a_faulty_ragged_batch_and_ends_like_a_clean_run():
    from mt_dualpipe.resilience import FaultKind

    for r in run_ranks(_rewind, 2, timeout=240):
        assert r["skipped"] == [NAN_STEP] and r["same"]
        assert len(r["faults"]) == 1 and r["faults"][0][0] == NAN_STEP
        assert r["faults"][0][1] >= FaultKind.NONFINITE_GRAD


# ----- mistakes, on 2 ranks (a linear stage each) --------------------------------------------------
DIM = 6
P2P_TIMEOUT = 20.0


def _mse(out, y):
    return ((out - y) ** 2).sum()


def _outcome(fn) -> tuple[str | None, str, float]:
    t = time.monotonic()
    try:
        fn()
        return None, "", time.monotonic() - t
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t


def _rows_case(rank: int) -> dict:
    """Micro-batches of 1, 3, 2 and 2 rows through 1F1B: losses and gradients for the parent to check."""
    from mt_dualpipe import Pipeline

    torch.manual_seed(0)
    stage = nn.Linear(DIM, DIM).double()
    xs, ys = _row_batches()
    pipe = Pipeline([stage], "1f1b", timeout=P2P_TIMEOUT)
    loss, out = pipe.step(*([xs] if rank == 0 else []), num_chunks=4, criterion=_mse if rank == 1 else None,
                          labels=(ys,) if rank == 1 else (), return_outputs=True)
    with torch.no_grad():  # inference: the last rank has no labels, yet learns from the agreement that it is ragged
        _, inferred = pipe.step(*([xs] if rank == 0 else []), num_chunks=4, return_outputs=True)
    return {"loss": None if loss is None else loss.tolist(), "grads": [p.grad.clone() for p in stage.parameters()],
            "outputs": out, "inferred": inferred}


def _row_batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    rows = (1, 3, 2, 2)
    return ([torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in rows],
            [torch.randn(n, DIM, generator=g, dtype=torch.float64) for n in rows])


def _mistakes(rank: int, world: int) -> dict:
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.resilience import fresh_group

    torch.manual_seed(0)
    x, y = torch.randn(8, DIM), torch.randn(8, DIM)
    xs, ys = list(x.split(2)), list(y.split(2))

    def linear(inputs=((xs,), (xs,)), labels=((ys,), (ys,)), chunks=4):
        pipe = Pipeline([nn.Linear(DIM, DIM)], "1f1b", fresh_group(), timeout=P2P_TIMEOUT)
        pipe.step(*(inputs[rank] if rank == 0 else ()), num_chunks=chunks, criterion=_mse,
                  labels=labels[rank] if rank == 1 else ())

    def dual(inputs, labels):
        pipe = DualPipe((nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)), process_group=fresh_group(), timeout=P2P_TIMEOUT)
        pipe.step(*inputs[rank], num_chunks=4, criterion=_mse, labels=labels[rank])

    cases = {
        "short_list": lambda: linear(inputs=((xs[:3],), ())),
        "dual_long_list": lambda: dual(((xs,), (xs[:2],)), ((ys[:2],), (ys[:2],))),
        "list_and_tensor": lambda: linear(labels=((), (y,))),
        "labels_not_wrapped": lambda: linear(labels=((), tuple(ys))),  # labels=ys: four batched label values
        "mixed_values": lambda: linear(inputs=((xs, x), ())),
        "mixed_on_one_rank": lambda: dual(((xs[:2],), (xs[:2],)), ((y[:4],), (ys[:2],))),
        "rows": lambda: linear(labels=((), ([y[:2], y[2:4], y[4:5], y[5:8]],))),
        "not_a_tensor": lambda: linear(inputs=(({"x": x},), ())),
    }
    out = {name: _outcome(fn) for name, fn in cases.items()}
    out["rows_ok"] = _rows_case(rank)
    return out


@pytest.fixture(scope="module")
def mistakes() -> list[dict]:
    return run_ranks(_mistakes, 2, timeout=240)


def _fast(results, case) -> list[str]:
    for r in results:
        kind, msg, seconds = r[case]
        assert kind == "PipelineError", (case, kind, msg)
        assert seconds < P2P_TIMEOUT / 2, f"{case}: took {seconds:.1f}s (a one-sided mistake must not wait)"
    return [r[case][1] for r in results]


def test_micro_batches_of_different_rows_equal_one_process(mistakes):
    stages = []
    for _ in range(2):  # each rank's stage: the same seeded linear layer
        torch.manual_seed(0)
        stages.append(nn.Linear(DIM, DIM).double())
    model = nn.Sequential(*stages)
    xs, ys = _row_batches()
    losses = [_mse(model(xm), ym) for xm, ym in zip(xs, ys)]
    torch.stack(losses).sum().backward()
    got = [r["rows_ok"] for r in mistakes]
    assert got[1]["loss"] == pytest.approx([float(v.detach()) for v in losses], rel=1e-12, abs=0)
    for r, stage in enumerate(stages):
        for g, p in zip(got[r]["grads"], stage.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)
    with torch.no_grad():  # a ragged step gives its outputs as a list, one tensor per micro-batch
        for outputs in (got[1]["outputs"], got[1]["inferred"]):
            assert type(outputs) is list
            assert [torch.equal(o, model(xm)) for o, xm in zip(outputs, xs)] == [True] * 4


def test_a_list_of_the_wrong_length_fails_on_every_rank(mistakes):
    own, peer = _fast(mistakes, "short_list")
    assert own == ("inputs 0 is a list of 3 micro-batches but num_chunks=4; pass a list of 4 tensors, one per "
                   "micro-batch")
    assert peer == ("rank 1: rank 0 passed its inputs as a list of 3 micro-batches, not one tensor per micro-batch of "
                    "its chain (its own error says more); every rank stops this step")


def test_dualpipe_wants_one_tensor_per_micro_batch_of_the_rank_s_chain(mistakes):
    own, peer = _fast(mistakes, "dual_long_list")
    assert own == ("inputs 0 is a list of 4 micro-batches but rank 0 feeds chain 0, which runs 2 of the step's "
                   "num_chunks=4 micro-batches; pass a list of 2 tensors, one per micro-batch")
    assert peer.startswith("rank 1: rank 0 passed its inputs as a list of 4 micro-batches")


def test_lists_on_one_rank_and_a_tensor_on_another_fail_on_every_rank(mistakes):
    for msg in _fast(mistakes, "list_and_tensor"):
        assert msg == ("the step mixes lists of micro-batches with batched tensors (rank 0's inputs: a list of 4, "
                       "rank 1's labels: batched tensors); pass every rank's inputs and labels the same way: lists "
                       "with one tensor per micro-batch (each list one value: step([x0, x1, ...], labels=([y0, y1, "
                       "...],))) or batched tensors that the step splits along batch_dim")
    # labels=ys (not labels=(ys,)) is four batched label values: the same refusal, with the hint
    assert all("rank 1's labels: batched tensors" in m for m in _fast(mistakes, "labels_not_wrapped"))


def test_lists_and_tensors_mixed_on_one_rank_fail_on_every_rank(mistakes):
    own, peer = _fast(mistakes, "mixed_values")
    assert own == ("inputs mix lists of micro-batches with batched tensors (inputs 1 is a Tensor of shape (8, 6)); "
                   "pass every value as a list with one tensor per micro-batch, or every value as one batched tensor")
    assert peer == ("rank 1: rank 0 mixes lists of micro-batches with batched tensors in its inputs and labels (its "
                    "own error says more); every rank stops this step")
    for msg in _fast(mistakes, "mixed_on_one_rank"):  # DualPipe's rank 0: lists of inputs, batched labels
        assert msg.startswith("the step mixes lists of micro-batches with batched tensors (rank 0's inputs: a list of "
                              "2, rank 0's labels: batched tensors, rank 1's inputs: a list of 2, rank 1's labels: a "
                              "list of 2); pass every rank's inputs and labels the same way")


def test_micro_batches_whose_inputs_and_labels_differ_in_rows_fail_on_every_rank(mistakes):
    for msg in _fast(mistakes, "rows"):
        assert msg == ("chain 0: the micro-batches of the inputs on rank 0 and of the labels on rank 1 hold different "
                       "rows along batch_dim (8 and 8 in all); micro-batch m's inputs and labels must have the same "
                       "number of rows")


def test_something_else_than_tensors_or_lists_fails_on_every_rank(mistakes):
    own, peer = _fast(mistakes, "not_a_tensor")
    assert own == "inputs must be Tensors, lists of Tensors (one per micro-batch) or None, got dict"
    assert peer.startswith("rank 1: rank 0 passed inputs or labels that are neither Tensors, lists of Tensors")
