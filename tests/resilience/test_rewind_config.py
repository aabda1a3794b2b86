"""``RewindConfig``: Rewind's settings as one dataclass; keyword construction still works and gives
the same configuration; the pipeline rebuilds itself (``rebuilt``), Rewind only calls it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.resilience import LocalPipeline, Rewind, RewindConfig, rebuild_pipeline


def _pipe():
    torch.manual_seed(0)
    return LocalPipeline([nn.Linear(4, 4), nn.Linear(4, 4)])


def test_keywords_and_config_build_the_same_rewind():
    pipe = _pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    by_keywords = Rewind(pipe, opt, num_chunks=2, snapshot_every=3, checkpoint_every=6, skip_policy="retry")
    cfg = RewindConfig(num_chunks=2, snapshot_every=3, checkpoint_every=6, skip_policy="retry")
    by_config = Rewind(pipe, opt, cfg)
    assert by_keywords.config == by_config.config == cfg
    assert (by_config.num_chunks, by_config.snapshot_every, by_config.checkpoint_every, by_config.skip_policy) == \
        (2, 3, 6, "retry")
    overridden = Rewind(pipe, opt, cfg, num_chunks=4)  # keywords replace fields of a given config
    assert overridden.config == dataclasses.replace(cfg, num_chunks=4) and cfg.num_chunks == 2
    assert RewindConfig().checkpoint_every == RewindConfig().snapshot_every == 10


def test_config_checks_its_fields():
    with pytest.raises(ValueError, match="keep must be an integer of at least 1, got 0"):
        RewindConfig(keep=0)
    with pytest.raises(ValueError, match="rebuild must be a callable, None or 'auto', got 'sometimes'"):
        RewindConfig(rebuild="sometimes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'snapshot_evry'"):
        Rewind(_pipe(), None, snapshot_evry=2)


class _Rebuildable(LocalPipeline):
    """A pipeline that knows how to rebuild itself: Rewind's "auto" must use exactly that."""

    def rebuilt(self, group=None):
        new = _Rebuildable(list(self.module))
        new.generation = getattr(self, "generation", 0) + 1
        return new


def test_auto_rebuild_asks_the_pipeline():
    plain = _pipe()
    assert Rewind(plain, torch.optim.SGD(plain.parameters(), lr=0.1)).rebuild is None
    pipe = _Rebuildable([nn.Linear(4, 4)])
    rw = Rewind(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
    assert rw.rebuild(pipe).generation == 1
    assert rebuild_pipeline(pipe).generation == 1
    with pytest.raises(TypeError, match="rebuild_pipeline needs a pipeline with a rebuilt\\(\\) method"):
        rebuild_pipeline(plain)


class _Recording(torch.optim.SGD):
    """SGD that logs its steps into a shared list of events."""

    def __init__(self, params, events):
        super().__init__(params, lr=0.1)
        self.events = events

    def step(self, closure=None):
        self.events.append("optimizer.step")
        return super().step(closure)


@pytest.mark.parametrize("hook", [False, True])
def test_the_optimizer_step_overlaps_the_agreement_unless_a_hook_must_see_the_verdict(hook):
    pipe = _pipe()
    events: list[str] = []
    rw = Rewind(pipe, _Recording(pipe.parameters(), events), num_chunks=2, criterion=lambda o, y: ((o - y) ** 2).mean(),
                grad_hook=(lambda: events.append("grad_hook")) if hook else None)
    start, finish = rw.agreement.start, rw.agreement.finish
    rw.agreement.start = lambda *a: events.append("agreement.start") or start(*a)
    rw.agreement.finish = lambda *a: events.append("agreement.finish") or finish(*a)
    x = torch.randn(4, 4)
    assert rw.step(lambda pos: {"inputs": (x,), "labels": (x,)}).ok
    if hook:
        assert events == ["agreement.start", "agreement.finish", "grad_hook", "optimizer.step"]
    else:
        assert events == ["agreement.start", "optimizer.step", "agreement.finish"]


def test_a_fault_agreed_after_an_overlapped_optimizer_step_is_undone():
    """The rank saw its step as good and stepped; the agreed verdict (here a loss spike) rewinds it."""
    pipe = _pipe()
    rw = Rewind(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), num_chunks=2,
                criterion=lambda o, y: ((o - y) ** 2).mean(), snapshot_every=1, spike_zscore=3.0, window=10)
    x = torch.randn(4, 4)
    for _ in range(10):
        assert rw.step(lambda pos: {"inputs": (x,), "labels": (x + 0.01 * pos,)}).ok
    before = [p.detach().clone() for p in pipe.parameters()]
    res = rw.step(lambda pos: {"inputs": (x,), "labels": (x + 100.0,)})
    assert not res.ok and res.fault.kind.label == "loss spike"
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
