"""The planner's memory estimate against a real run of the tiny DeepSeek-V3 on the runtime (2 gloo ranks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ds = pytest.importorskip("mt_dualpipe.models.deepseek_v3")
runtime = pytest.importorskip("mt_dualpipe.runtime.modules")

from mt_dualpipe.planner import PRESETS, ModelSpec, Strategy, estimate  # noqa: E402
from mt_dualpipe.planner.profile import SavedBytes  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402

SEQ, M, P = 64, 4, 2


def _rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    cfg = ds.DeepSeekV3Config.preset("tiny")
    (module,) = ds.build_stages(cfg, world, indices=[rank])
    last = rank == world - 1
    pipe = runtime.Pipeline([module], "1f1b", timeout=60)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (M, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (M, SEQ), generator=g)
    pipe.step(tokens if rank == 0 else None, num_chunks=M, criterion=module.criterion if last else None,
              labels=(labels,) if last else ())
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    opt.step()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    # bytes one in-flight micro-batch keeps on this stage (what autograd saves for its backward)
    x = tokens[:1] if rank == 0 else torch.randn(1, SEQ, cfg.dim, requires_grad=True)
    with SavedBytes(list(module.parameters())) as saved:
        out = module(x)
        if last:
            module.criterion(out, labels[:1])
    return {"peak": pipe.peak_activations, "params": params, "grads": grads, "optimizer": state,
            "act": saved.bytes, "total": params + grads + state + pipe.peak_activations * saved.bytes}


@pytest.mark.slow
def test_memory_estimate_within_10_percent_of_runtime_peak():
    cfg = ds.DeepSeekV3Config.preset("tiny")
    got = run_ranks(_rank, P, timeout=240)
    layers = tuple(ds.parse_layout(cfg, P))
    st = Strategy(P, "1f1b", M, ep=1, dp=1, micro_batch_size=1, seq_len=SEQ, zero=0, dtype="fp32",
                  recompute="none", layers_per_stage=layers, attention="eager")
    est = estimate(ModelSpec.from_deepseek_config(cfg), PRESETS["h100"], st)
    for r, rec in enumerate(got):
        assert rec["peak"] == P - r  # 1F1B: P - r micro-batches in flight on rank r
        assert est.per_rank_gb[r] * 1e9 == pytest.approx(rec["total"], rel=0.10), (r, rec)
    worst = max(got, key=lambda rec: rec["total"])
    assert est.memory_gb["total"] * 1e9 == pytest.approx(worst["total"], rel=0.10)
    acts = _planned_activations(est)
    for r, rec in enumerate(got):
        # activations alone (the estimated part: saved bytes per token of an eager implementation)
        assert acts[r] == pytest.approx(rec["peak"] * rec["act"], rel=0.10), (r, acts[r], rec)
        # weights, gradients and Adam's two moments are counted exactly
        assert est.per_rank_gb[r] * 1e9 - acts[r] == pytest.approx(rec["params"] + rec["grads"] + rec["optimizer"],
                                                                    rel=1e-6)


def _planned_activations(est) -> list[float]:
    """The activation part of each rank's estimate, in bytes (total minus the parameter-sized parts)."""
    from mt_dualpipe.planner.estimate import activation_peak_bytes, stage_items
    from mt_dualpipe.schedules import build_schedule

    st = est.strategy
    cfg = ds.DeepSeekV3Config.preset("tiny")
    stages = stage_items(ModelSpec.from_deepseek_config(cfg), st, PRESETS["h100"])
    sched = build_schedule(st.schedule, st.pp, st.num_microbatches)
    stage_bytes = [sum(i.act_bytes for i in g) * st.seq_len * st.micro_batch_size for g in stages]
    return [activation_peak_bytes(sched.ranks[r], stage_bytes) for r in range(st.pp)]
