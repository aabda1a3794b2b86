"""Qwen3-MoE on one pp x ep mesh: expert parallelism inside a pipeline, the pipeline's own gradient sync and
ZeRO-1 against the single-process model.

4 processes: pp = 2 x ep = 2 (dp = 1). Every worker builds the same seeded float64 model and runs the
single-process reference over the whole global batch itself (each replica's micro-batch losses
backpropagated as is, averaged over the 2 ep replicas: what ``Pipeline(mesh=)`` computes); then its own
part: stages whose MoE layers hold half the experts (``ep_group`` = the mesh's ep group),
``Pipeline(mesh=, dp_mode="zero1", dp_batch="local")``, one SGD step through ``pipe.build_optimizer``.
The losses and every parameter after the step (dense ones reduced over the ep replicas, experts kept to
their shard) must equal the reference.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, criterion_for, stages_for_rank
from tests.helpers.dist import run_ranks
from tests.helpers.parallel import assert_params_match, rank_micro_batches

LR = 0.5
NUM_MB = 4


def _config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig.preset("tiny", vocab_size=64)


def _data(config: Qwen3MoeConfig, replicas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(replicas):
        tokens = [torch.randint(0, config.vocab_size, (1, 9), generator=g) for _ in range(NUM_MB)]
        out.append([(t[:, :-1], t[:, 1:]) for t in tokens])
    return out


def _step(rank: int, world: int, schedule: str) -> tuple[str | None, dict | None]:
    try:
        from mt_dualpipe import Pipeline
        from mt_dualpipe.parallel import init_parallel
        from mt_dualpipe.schedules.registry import build_schedule

        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1)
        config, replicas = _config(), 2
        data = _data(config, replicas)
        torch.manual_seed(0)
        start = Qwen3MoeForCausalLM(config)
        ref = Qwen3MoeForCausalLM(config)
        ref.load_state_dict(start.state_dict())
        ref_losses = {}
        for r, mbs in enumerate(data):
            for m, (x, y) in enumerate(mbs):
                loss = ref(x, y)
                (loss / replicas).backward()
                ref_losses[r, m] = loss.detach()
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad

        dims = init_parallel(pp=2, dp=1, ep=2)
        sched = build_schedule(schedule, 2, NUM_MB)
        pp_rank = dims.coord("pp")
        mods = stages_for_rank(config, sched, pp_rank, source=start, ep_group=dims.group("ep"))
        pipe = Pipeline(mods, sched, mesh=dims, dp_mode="zero1", dp_batch="local", timeout=60)
        opt = pipe.build_optimizer(lambda params: torch.optim.SGD(params, lr=LR))
        replica = dims.coord("ep")
        inputs, labels, last = rank_micro_batches(sched, pp_rank, data[replica])
        opt.zero_grad()
        loss, _ = pipe.step(*inputs, num_chunks=NUM_MB, criterion=criterion_for(mods), labels=labels)
        opt.step()
        if last:
            want = torch.stack([ref_losses[replica, m] for m in sched.microbatches_of(last[0])])
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        checked = assert_params_match(mods, ref, schedule)
        experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for m in mods for n, _ in m.named_parameters()
                          if ".experts." in n})
        return None, {"checked": checked, "experts": experts}
    except BaseException:
        return traceback.format_exc(), None


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_pp2_ep2_zero1_one_step_equals_single_process(schedule):
    results = run_ranks(_step, 4, schedule, timeout=240)
    errors = [f"rank {r}:\n{err}" for r, (err, _) in enumerate(results) if err is not None]
    assert not errors, "\n".join(errors)
    got = [res for _, res in results]
    assert all(r["checked"]["expert"] > 0 and r["checked"]["dense"] > 0 for r in got)
    # global rank = pp * 2 + ep: the two EP ranks of a pipeline position hold disjoint halves of the 4 experts
    for pp in range(2):
        a, b = got[2 * pp]["experts"], got[2 * pp + 1]["experts"]
        assert a and b and not set(a) & set(b) and sorted(a + b) == [0, 1, 2, 3]
