"""A user's own activation checkpointing under the split schedules: each checkpointed block recomputes
exactly once per micro-batch, in B, and the gradients equal a single process without checkpointing.

Every block counts its forward calls (F and each recompute). Per step a stage's block must run
2 × (micro-batches it processes): once in F, once in B's recompute, none in W. Three kinds of
non-reentrant checkpointing (``checkpoint_wrapper``, ``torch.utils.checkpoint`` and selective
op-level AC), under the generic split (plain ``nn.Linear``) and with ``defer_weight_grads``, on
1F1B (no W: the reference count), ZB-H1, ZB-V, DualPipeV and DualPipe, 2 gloo ranks, 6 micro-batches.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mt_dualpipe.runtime import checkpoint_reuse
from mt_dualpipe.schedules import build_schedule
from tests.helpers.dist import run_ranks
from tests.helpers.models import H, chain_batch, check_against_reference, criterion, make_data

SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev", "dualpipe")
KINDS = (None, "wrapper", "function", "selective")  # None: no checkpointing
M = 6


class Block(nn.Module):
    """A residual MLP block that counts its forward calls (F and every recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.b(torch.tanh(self.a(x)))


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, kind: str) -> None:
        super().__init__()
        self.block, self.kind = block, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "function":
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))


class TwoBlocks(nn.Module):
    """One pipeline stage: two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def calls(self) -> list[int]:
        return [m.calls for m in self.modules() if isinstance(m, Block)]


def _checkpointed_copy(plain: TwoBlocks, kind: str) -> TwoBlocks:
    """A copy of ``plain`` whose blocks run under the user's checkpointing of ``kind``."""
    out = copy.deepcopy(plain)
    if kind == "wrapper":
        out.blocks = nn.ModuleList([checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                                    for b in out.blocks])
    else:
        out.blocks = nn.ModuleList([_Checkpointed(b, kind) for b in out.blocks])
    return out


def _worker(rank: int, world: int, cases: list) -> list[dict]:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime import defer_weight_grads

    torch.set_num_threads(1)
    got = []
    for sched, kind, defer, layers, x, labels in cases:
        local = sched.local_stages(rank)
        mods = [copy.deepcopy(layers[s]) if kind is None else _checkpointed_copy(layers[s], kind) for _, s in local]
        if defer:
            mods = [defer_weight_grads(m) for m in mods]
        pipe = Pipeline(mods, sched, timeout=30)
        pipe.record_activation_bytes = True
        m = sched.num_microbatches
        first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
        last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
        inp = (chain_batch(sched, first[0], x, m),) if first else ()
        lab = (chain_batch(sched, last[0], labels, m),) if last else ()
        loss, outs = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
        got.append({"local": local, "loss": loss, "outputs": outs, "chain_end": last,
                    "grads": [[p.grad for p in mod.parameters()] for mod in mods],
                    "calls": [mod.calls() for mod in mods], "peak": pipe.peak_activation_bytes})
    return got


@functools.cache
def _results() -> tuple[list, list]:
    cases = []
    for name in SCHEDULES:
        sched = build_schedule(name, 2, M)
        torch.manual_seed(len(cases))
        layers = [TwoBlocks().double() for _ in range(len(sched.placement[0]))]
        x, labels = make_data(M, seed=3)
        for kind in KINDS:
            for defer in (False, True):
                cases.append((sched, kind, defer, layers, x, labels))
    per_rank = run_ranks(_worker, 2, cases, timeout=240)
    return cases, [[per_rank[r][i] for r in range(2)] for i in range(len(cases))]


@pytest.mark.skipif(not checkpoint_reuse.supported(), reason="this torch cannot share a checkpoint's recompute")
@pytest.mark.parametrize("name", SCHEDULES)
def test_each_checkpointed_block_recomputes_once_in_b(name):
    cases, results = _results()
    for (sched, kind, defer, *_), res in zip(cases, results):
        if sched.name != name:
            continue
        per_chain = {c: len(sched.microbatches_of(c)) for c in range(len(sched.placement))}
        runs = 1 if kind is None else 2  # F, and with checkpointing once more in B (never in W)
        for r in res:
            for (c, s), calls in zip(r["local"], r["calls"]):
                assert calls == [runs * per_chain[c]] * 2, (name, kind, defer, (c, s), calls)


@pytest.mark.parametrize("name", SCHEDULES)
def test_checkpointing_lowers_the_recorded_activation_peak(name):
    """The recorded peak (saved tensors, plus what B's recompute keeps for W) with checkpointing is at most
    the peak without on every rank, and below it summed over the ranks, for the generic split and for
    deferred W alike. (Between B and W a split keeps the linears' inputs either way, so on a rank whose
    peak falls in that window checkpointing cannot lower it.)"""
    cases, results = _results()
    peaks = {(kind, defer): [r["peak"] for r in res]
             for (sched, kind, defer, *_), res in zip(cases, results) if sched.name == name}
    for defer in (False, True):
        for kind in KINDS[1:]:
            ac, plain = peaks[kind, defer], peaks[None, defer]
            assert all(0 < a <= p for a, p in zip(ac, plain)) and sum(ac) < sum(plain), (name, kind, defer, peaks)


@pytest.mark.parametrize("name", SCHEDULES)
def test_gradients_equal_one_process_without_checkpointing(name):
    cases, results = _results()
    for (sched, _, _, layers, x, labels), res in zip(cases, results):
        if sched.name == name:
            check_against_reference(sched, res, [copy.deepcopy(m) for m in layers], x, labels)
