"""Bad input gets one clear error, and nothing hangs.

Schedule parameters are checked by the compiler (``ScheduleError``); the runtime checks are
exercised on 2 gloo ranks in one launch, each with its own fresh process group and a 2 s
point-to-point timeout, so a check that is missing shows up as a wrong message, never as a hang.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.resilience import BadInputError, LocalPipeline, check_finite_inputs
from mt_dualpipe.schedules.errors import ScheduleError
from mt_dualpipe.schedules.registry import build_schedule

P2P_TIMEOUT = 2.0
DIM = 6


# ----- schedule parameters (compiler) ------------------------------------------------------------
@pytest.mark.parametrize("name, P, M, options, message", [
    ("dualpipe", 3, 12, {}, "dualpipe needs an even number of ranks, got 3"),
    ("dualpipe", 4, 4, {}, r"dualpipe needs at least 2\*num_ranks = 8 micro-batches, got 4"),
    ("1f1b", 0, 4, {}, "num_ranks must be at least 1, got 0"),
    ("1f1b", 2, 2.5, {}, "num_microbatches must be an integer, got 2.5"),
    ("zb-h1", 2, 4, {"chunks": 2}, "schedule 'zb-h1' got unknown option\\(s\\) chunks; it takes no options"),
    ("no-such-schedule", 2, 4, {}, "unknown schedule 'no-such-schedule'; available:"),
])
def test_invalid_schedule_parameters_raise_schedule_error(name, P, M, options, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, P, M, **options)


# ----- single-process guards ---------------------------------------------------------------------
def test_nan_input_is_refused_by_the_guard():
    x = torch.ones(4, 3)
    check_finite_inputs(x, (x, {"k": torch.arange(3)}))  # finite (and integer) inputs pass
    x[2, 1] = float("inf")
    with pytest.raises(BadInputError, match=r"batch 7: input tensor 1 \(shape \(4, 3\), float32\) has 1 non-finite "
                                            r"value \(NaN or inf\); only finite inputs are allowed"):
        check_finite_inputs(torch.zeros(2), x, where="batch 7")


def test_dualpipe_needs_two_modules():
    from mt_dualpipe import DualPipe, DualPipeV

    with pytest.raises(Exception, match=r"DualPipe takes two modules \(stage r, stage P-1-r\), got 1"):
        DualPipe((nn.Linear(2, 2),))
    with pytest.raises(Exception, match=r"DualPipeV takes two modules .* got 3"):
        DualPipeV((nn.Linear(2, 2),) * 3)


def test_local_pipeline_refuses_a_batch_not_divisible_into_micro_batches():
    pipe = LocalPipeline([nn.Linear(DIM, DIM)])
    with pytest.raises(ValueError, match=r"inputs of shape \(10, 6\) cannot be split into 4 equal micro-batches"):
        pipe.step(torch.randn(10, DIM), num_chunks=4, criterion=lambda o, y: o.sum(), labels=(torch.randn(10, DIM),))


# ----- the runtime, on 2 ranks -------------------------------------------------------------------
class DictStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return {"h": self.lin(x)}


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _worker(rank: int, world: int, out: str) -> None:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.resilience import Rewind, fresh_group

    torch.manual_seed(0)
    x, y = torch.randn(8, DIM), torch.randn(8, DIM)
    results = {}

    def run(mods, inputs, labels, chunks=4):
        pipe = Pipeline(mods, "1f1b", fresh_group(), timeout=P2P_TIMEOUT)
        pipe.step(*(inputs if rank == 0 else ()), num_chunks=chunks, criterion=_mse,
                  labels=labels if rank == 1 else ())

    cases = {
        "module_count": lambda: run([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)], (x,), (y,)),
        "not_divisible": lambda: run([nn.Linear(DIM, DIM)], (torch.randn(10, DIM),), (torch.randn(10, DIM),)),
        "missing_labels": lambda: run([nn.Linear(DIM, DIM)], (x,), ()),
        "non_tensor_output": lambda: run([DictStage() if rank == 0 else nn.Linear(DIM, DIM)], (x,), (y,)),
        "shape_mismatch": lambda: run([nn.Linear(DIM, DIM) if rank == 0 else nn.Linear(DIM - 1, DIM)], (x,), (y,)),
    }
    for name, fn in cases.items():
        t = time.monotonic()
        try:
            fn()
            results[name] = (None, "", time.monotonic() - t)
        except Exception as exc:
            results[name] = (type(exc).__name__, str(exc), time.monotonic() - t)

    # NaN in the input under Rewind: every rank agrees on a "non-finite input" fault, the batch is skipped
    pipe = Pipeline([nn.Linear(DIM, DIM)], "1f1b", fresh_group(), timeout=P2P_TIMEOUT)
    rw = Rewind(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), num_chunks=4, criterion=_mse, snapshot_every=1)

    def batch(pos):
        xb = x.clone()
        if pos == 1:
            xb[3, 2] = float("nan")
        return {"inputs": (xb,)} if rank == 0 else {"labels": (y,)}

    rw.run(batch, 3)
    results["nan_input"] = [(int(e.kind), e.ranks, e.cause, e.skipped) for e in rw.events]
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runtime_errors(tmp_path_factory) -> list[dict]:
    from tests.helpers.launch import launch

    out = tmp_path_factory.mktemp("bad_input")
    assert launch(_worker, 2, str(out), timeout=120) == [0, 0]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _outcome(results, rank, case):
    kind, msg, seconds = results[rank][case]
    assert seconds < 3 * P2P_TIMEOUT + 5, f"{case} on rank {rank} took {seconds:.1f}s"  # no hang
    return kind, msg


def test_wrong_number_of_modules(runtime_errors):
    for rank in range(2):
        kind, msg = _outcome(runtime_errors, rank, "module_count")
        assert kind == "PipelineError"
        assert f"rank {rank} runs 1 stage(s) [(0, {rank})] of schedule '1f1b' but was given 2 module(s)" in msg


def test_non_tensor_stage_output(runtime_errors):
    kind, msg = _outcome(runtime_errors, 0, "non_tensor_output")
    assert kind == "PipelineError" and "DictStage, micro-batch 0, returned a dict; a stage must return a Tensor" in msg
    kind, msg = _outcome(runtime_errors, 1, "non_tensor_output")  # the peer stops too, naming rank 0's error
    assert kind == "PipelinePeerError" and msg.startswith("rank 1: rank 0 failed") and "returned a dict" in msg


def test_batch_not_divisible_into_micro_batches(runtime_errors):
    for rank, what in ((0, "inputs"), (1, "labels")):
        kind, msg = _outcome(runtime_errors, rank, "not_divisible")
        assert kind == "PipelineError"
        assert msg.startswith(f"{what} of shape (10, 6): a batch of 10 along batch_dim=0 does not split into "
                              "num_chunks=4 equal micro-batches; use a batch size divisible by 4"), msg


def test_labels_missing_where_the_loss_is_computed(runtime_errors):
    kind, msg = _outcome(runtime_errors, 1, "missing_labels")
    assert kind == "PipelineError"
    assert msg.startswith("rank 1 F(chain 0, stage 1, mb 0) in Linear: the criterion was called without labels and "
                          "raised TypeError: _mse() missing 1 required positional argument: 'y'; rank 1 holds the "
                          "last stage 1 of chain 0, so pass labels= to step() here"), msg
    kind, msg = _outcome(runtime_errors, 0, "missing_labels")  # the peer stops waiting for a gradient that never comes
    assert kind == "PipelinePeerError" and msg.startswith("rank 0: rank 1 failed") and "without labels" in msg


def test_mismatched_shapes_between_ranks(runtime_errors):
    kind, msg = _outcome(runtime_errors, 1, "shape_mismatch")
    assert kind == "PipelineError"
    assert msg == ("rank 1 F(chain 0, stage 1, mb 0) in Linear: RuntimeError: mat1 and mat2 shapes cannot be "
                   "multiplied (2x6 and 5x6)"), msg


def test_mismatched_shapes_between_ranks_fail_fast_on_both_ranks(runtime_errors):
    kind, msg = _outcome(runtime_errors, 1, "shape_mismatch")
    assert kind is not None and "(2x6 and 5x6)" in msg
    kind, msg = _outcome(runtime_errors, 0, "shape_mismatch")
    assert kind == "PipelinePeerError" and msg.startswith("rank 0: rank 1 failed") and "(2x6 and 5x6)" in msg


def test_nan_in_the_input_is_an_agreed_fault_and_the_batch_is_skipped(runtime_errors):
    for rank in range(2):
        (kind, ranks, cause, skipped), = runtime_errors[rank]["nan_input"]
        assert 0 in ranks and skipped  # rank 1 also saw the NaN loss it caused; the input is named first
        assert "rank 0: input tensor 0 (shape (8, 6), float32) has 1 non-finite value" in cause
        assert kind == 4  # FaultKind.NONFINITE_INPUT
