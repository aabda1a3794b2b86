"""A newcomer's mistakes fail fast, on every rank, with a message naming what differs.

Two launches: one rank for what a single process shows (a non-scalar loss, outputs that cannot
be concatenated, a bad schedule name or module count caught by the constructor), two gloo ranks
for the one-sided mistakes, which used to fail on one rank while the other waited for the whole
point-to-point timeout. Each case gets a fresh process group and a 20 s timeout; a case "fails
fast" when both ranks raise in well under that.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from tests.helpers.dist import run_ranks

DIM = 6
P2P_TIMEOUT = 20.0


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _outcome(fn) -> tuple[str | None, str, float]:
    t = time.monotonic()
    try:
        fn()
        return None, "", time.monotonic() - t
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t


# ----- one rank ----------------------------------------------------------------------------------
class WithScalar(nn.Module):
    """A last stage that also returns a 0-dim tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.lin(x)
        return h, h.sum()


class Narrowing(nn.Module):
    """Output width varies between micro-batches: each micro-batch keeps ``x[0, 0]`` columns."""

    def forward(self, x):
        return x[:, : int(x[0, 0].item())] * 2


def _one_rank(rank, world):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.resilience import fresh_group

    torch.manual_seed(0)
    out = {}
    x, y = torch.randn(4, DIM), torch.randn(4, DIM)

    def nonscalar():
        pipe = Pipeline([nn.Linear(DIM, DIM)], "1f1b", fresh_group())
        pipe.step(x, num_chunks=2, criterion=lambda o, t: (o - t) ** 2, labels=(y,))

    out["nonscalar"] = _outcome(nonscalar)

    pipe = Pipeline([WithScalar()], "1f1b", fresh_group())
    loss, (h, s) = pipe.step(x, num_chunks=2, criterion=lambda o, t, yy: _mse(o, yy), labels=(y,),
                             return_outputs=True)
    ref = pipe.module[0](x)[0].detach()
    out["zero_dim"] = (torch.equal(h, ref), type(s).__name__, [tuple(t.shape) for t in s],
                       [float(t) for t in s], [float(r.sum()) for r in ref.split(2)])

    xs = torch.randn(4, DIM)
    xs[0, 0], xs[2, 0] = 3.0, 5.0  # micro-batch 0 keeps 3 columns, micro-batch 1 keeps 5
    with torch.no_grad():
        _, o = Pipeline([Narrowing()], "1f1b", fresh_group()).step(xs, num_chunks=2, return_outputs=True)
    out["varying"] = (type(o).__name__, [torch.equal(a, b) for a, b in zip(o, (xs[:2, :3] * 2, xs[2:, :5] * 2))])

    out["unknown_name"] = _outcome(lambda: Pipeline([nn.Linear(DIM, DIM)], "no-such", fresh_group()))
    out["module_count"] = _outcome(lambda: Pipeline([nn.Linear(DIM, DIM)] * 3, "zbv", fresh_group()))
    out["unknown_option"] = _outcome(lambda: Pipeline([nn.Linear(DIM, DIM)], "1f1b", fresh_group(),
                                                      schedule_options={"chunks": 2}))
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_ranks(_one_rank, 1, timeout=120)[0]


def test_non_scalar_loss_is_refused_like_pytorch(one_rank):
    kind, msg, _ = one_rank["nonscalar"]
    assert kind == "PipelineError"
    assert msg == ("rank 0 F(chain 0, stage 0, mb 0) in Linear: the criterion returned a tensor of shape (2, 6); a "
                   "training step needs a scalar loss Tensor per micro-batch (PyTorch's backward() refuses a "
                   "non-scalar one too): reduce it, e.g. reduction='mean' or .sum()")


def test_return_outputs_with_a_zero_dim_output_gives_a_list_per_micro_batch(one_rank):
    same_h, kind, shapes, sums, ref_sums = one_rank["zero_dim"]
    assert same_h and kind == "list" and shapes == [(), ()]
    assert sums == pytest.approx(ref_sums, rel=1e-6)


def test_return_outputs_with_varying_shapes_gives_a_list_per_micro_batch(one_rank):
    assert one_rank["varying"] == ("list", [True, True])


def test_bad_schedule_or_module_count_fails_in_the_constructor(one_rank):
    kind, msg, _ = one_rank["unknown_name"]
    assert kind == "PipelineError" and msg.startswith("unknown schedule 'no-such'; available: "), msg
    kind, msg, _ = one_rank["module_count"]
    assert kind == "PipelineError"
    assert msg == ("rank 0 runs 2 stage(s) [(0, 0), (0, 1)] of schedule 'zbv' but was given 3 module(s); "
                   "pass one module per stage, in (chain, stage) order")
    kind, msg, _ = one_rank["unknown_option"]
    assert (kind, msg) == ("PipelineError", "schedule '1f1b' got unknown option(s) chunks; it takes no options")


# ----- two ranks: one-sided mistakes ------------------------------------------------------------
def _two_ranks(rank, world):
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.resilience import fresh_group

    torch.manual_seed(0)
    x, y = torch.randn(8, DIM), torch.randn(8, DIM)
    out = {}

    def linear(inputs=(x,), labels=(y,), chunks=(4, 4), grad=(True, True)):
        pipe = Pipeline([nn.Linear(DIM, DIM)], "1f1b", fresh_group(), timeout=P2P_TIMEOUT)
        with torch.set_grad_enabled(grad[rank]):
            pipe.step(*(inputs if rank == 0 else ()), num_chunks=chunks[rank], criterion=_mse,
                      labels=labels if rank == 1 else ())

    def dual_labels():  # both ranks compute a loss; rank 1 forgets its labels
        pipe = DualPipe((nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)), process_group=fresh_group(), timeout=P2P_TIMEOUT)
        pipe.step(x, num_chunks=4, criterion=lambda o, *t: o.pow(2).mean(), labels=(y,) if rank == 0 else ())

    cases = {
        "num_chunks": lambda: linear(chunks=(4, 2)),
        "not_divisible": lambda: linear(inputs=(torch.randn(10, DIM),), labels=(torch.randn(10, DIM),))
        if rank == 0 else linear(),
        "batch_size": lambda: linear(labels=(torch.randn(12, DIM),)),
        "no_inputs": lambda: linear(inputs=()),
        "grad_mode": lambda: linear(grad=(True, False)),
        "dual_labels": dual_labels,
    }
    for name, fn in cases.items():
        out[name] = _outcome(fn)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout=240)


def _fast(results, case):
    for r in results:
        kind, msg, seconds = r[case]
        assert kind == "PipelineError", (case, kind, msg)
        assert seconds < P2P_TIMEOUT / 2, f"{case}: took {seconds:.1f}s (a one-sided mistake must not wait)"
    return [r[case][1] for r in results]


def test_different_num_chunks_fails_on_every_rank(two_ranks):
    for msg in _fast(two_ranks, "num_chunks"):
        assert msg == ("the ranks disagree on num_chunks (rank 0: 4, rank 1: 2); pass the same num_chunks to "
                       "step() on every rank")


def test_a_batch_that_does_not_split_on_one_rank_fails_on_every_rank(two_ranks):
    own, peer = _fast(two_ranks, "not_divisible")
    assert own.startswith("inputs of shape (10, 6): a batch of 10 along batch_dim=0 does not split into num_chunks=4")
    assert peer == ("rank 1: rank 0 its inputs do not split into num_chunks micro-batches (its own error says more); "
                    "every rank stops this step")


def test_a_different_batch_size_names_both_ranks(two_ranks):
    for msg in _fast(two_ranks, "batch_size"):
        assert msg == ("chain 0: the inputs on rank 0 have a batch of 8 but the labels on rank 1 have 12; both are "
                       "split into the same num_chunks micro-batches, so pass the same batch size on every rank")


def test_missing_inputs_on_the_first_rank_fails_on_every_rank(two_ranks):
    own, peer = _fast(two_ranks, "no_inputs")
    assert own == "rank 0 holds the first stage of chain 0 and needs the step's inputs"
    assert peer.startswith("rank 1: rank 0 got no inputs although it holds the first stage of a chain")


def test_one_rank_under_no_grad_fails_on_every_rank(two_ranks):
    for msg in _fast(two_ranks, "grad_mode"):
        assert msg.startswith("the ranks disagree on the kind of step (1: training, 0: inference under "
                              "torch.no_grad()) (rank 0: 1, rank 1: 0)")


def test_labels_missing_on_one_of_the_loss_ranks_fails_on_every_rank(two_ranks):
    for msg in _fast(two_ranks, "dual_labels"):
        assert msg == ("rank(s) 1 hold the last stage of a chain but passed no labels, while rank(s) 0 did; pass "
                       "labels= to step() on every rank that computes a loss")
