"""Recompute policies: gradients bit-equal to no recompute, each region recomputed once in B and never in W
(the zero-bubble split), fewer saved activation bytes (the runtime's recorded peak on 2 ranks); single process
and 2-rank pipelines."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3 import build_stages as deepseek_stages
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM
from mt_dualpipe.models.llama.stages import build_stages as llama_stages
from mt_dualpipe.models.recompute import POLICIES, SavedActivationMeter, apply_recompute
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from tests.helpers.dist import run_ranks
from tests.helpers.fb_units import fb_unit_counter

torch.set_num_threads(1)
MODELS = ("deepseek", "llama")


def deepseek_config() -> DeepSeekV3Config:
    return DeepSeekV3Config.preset("tiny", dim=64, n_layers=3, vocab_size=64, inter_dim=128, moe_inter_dim=32,
                                   max_seq_len=64, mtp_depth=1)


def llama_config() -> LlamaConfig:
    return LlamaConfig.preset("tiny", num_hidden_layers=4, vocab_size=64)


def model_and_stages(kind: str, policy: str, num_stages: int = 2):
    torch.manual_seed(0)
    if kind == "deepseek":
        config = deepseek_config()
        model = DeepSeekV3Model(config)
        return config, model, deepseek_stages(config, num_stages, source=model, recompute=policy)
    config = llama_config()
    model = LlamaForCausalLM(config)
    return config, model, llama_stages(config, num_stages, source=model, recompute=policy)


def batch(config, seed: int, rows: int = 2, seq: int = 16):
    vocab = config.vocab_size
    t = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def split_step(stages, micro_batches, meter: SavedActivationMeter | None = None):
    """All forwards, then per micro-batch B (weight GEMMs queued) and later W, as a zero-bubble stage would."""
    first, last = stages
    store = WeightGradStore()
    pending = []
    ctx = meter.measure() if meter is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        for x, y in micro_batches:
            pending.append(last.criterion(last(first(x)), y))
    calls_after_f = [dict(st.recompute_calls) for st in stages]
    for loss in pending:
        with store.deferring():
            loss.backward()
    calls_after_b = [dict(st.recompute_calls) for st in stages]
    while len(store):
        store.run_oldest()
    calls_after_w = [dict(st.recompute_calls) for st in stages]
    grads = {f"{i}.{n}": p.grad.clone() for i, st in enumerate(stages) for n, p in st.named_parameters()
             if p.grad is not None}
    return grads, calls_after_f, calls_after_b, calls_after_w, store.closures_run


@pytest.mark.parametrize("kind", MODELS)
def test_each_policy_gives_bit_equal_gradients_recomputing_once_in_b_never_in_w(kind):
    config, _, _ = model_and_stages(kind, "none")
    mbs = [batch(config, seed) for seed in range(3)]
    results, peaks = {}, {}
    for policy in POLICIES:
        _, _, stages = model_and_stages(kind, policy)
        meter = SavedActivationMeter()
        results[policy] = split_step(stages, mbs, meter)
        peaks[policy] = meter.peak
    ref = results["none"][0]
    assert len(ref) > 10 and results["none"][4] > 0  # W ran queued weight GEMMs
    for policy in ("selective", "full"):
        grads, after_f, after_b, after_w, closures = results[policy]
        assert grads.keys() == ref.keys()
        assert all(torch.equal(grads[k], ref[k]) for k in ref), policy
        assert closures == results["none"][4]  # the same weight GEMMs were deferred to W
        for f, b, w in zip(after_f, after_b, after_w):
            assert b == {k: 2 * v for k, v in f.items()}  # each region: once in F, once more in B
            assert w == b  # W recomputes nothing
        assert sum(sum(f.values()) for f in after_f) > 0
    print(f"\n{kind} saved-activation peak bytes per policy: {peaks}")
    assert peaks["selective"] < peaks["none"] and peaks["full"] < peaks["selective"]


def test_unknown_policy_is_refused():
    _, _, stages = model_and_stages("llama", "none")
    with pytest.raises(ValueError, match=r"unknown recompute policy 'some'; choose one of \('none', 'selective', "
                                         r"'full'\)"):
        apply_recompute(stages[0], "some")
    with pytest.raises(ValueError, match="has no layer that declares recompute regions"):
        apply_recompute(torch.nn.Linear(2, 2), "full")


def test_selective_with_the_savers_that_already_rebuild_its_regions_is_no_error():
    """The "attention" and "swiglu" savers rebuild in B what "selective" would: a stage built with both has
    declaring layers but no region left for the policy, and builds (what a plan counting the savers launches)."""
    config = llama_config().replace(memory_savers="attention,swiglu")
    stages = llama_stages(config, 2, recompute="selective")
    assert all(st.recompute_policy == "selective" and not st.recompute_calls for st in stages)


# ----- 2 gloo ranks ------------------------------------------------------------------------------------------
def _pipeline_worker(rank, world, kind, schedule, num_mb):
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.models.deepseek_v3 import criterion_for, stages_for_rank, sync_replicas
    from mt_dualpipe.models.llama.stages import stages_for_rank as llama_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    sched = build_schedule(schedule, world, num_mb)
    out = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        if kind == "deepseek":
            config = deepseek_config()
            model = DeepSeekV3Model(config)
            mods = stages_for_rank(config, sched, rank, source=model, recompute=policy)
        else:
            config = llama_config()
            model = LlamaForCausalLM(config)
            mods = llama_for_rank(config, sched, rank, source=model, recompute=policy)
        data = [batch(config, 100 + m, rows=1) for m in range(num_mb)]
        pipe = DualPipe(tuple(mods), timeout=120) if schedule == "dualpipe" else Pipeline(mods, sched, timeout=120)
        first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
        last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
        inputs = [torch.cat([data[m][0] for m in sched.microbatches_of(first[0])])] if first else []
        labels = (torch.cat([data[m][1] for m in sched.microbatches_of(last[0])]),) if last else ()
        criterion = criterion_for(mods)
        pipe.record_activation_bytes = True  # the runtime's own peak of saved-activation bytes on this rank
        with fb_unit_counter() as overlapped:
            pipe.step(*inputs, num_chunks=num_mb, criterion=criterion, labels=labels)
        sync_replicas(mods, dist.group.WORLD)
        grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
                 if p.grad is not None}
        calls = [dict(m.recompute_calls) for m in mods]
        out[policy] = (grads, calls, pipe.peak_activation_bytes, len(overlapped))
    ref = out["none"][0]
    for policy in ("selective", "full"):
        grads, calls, _, _ = out[policy]
        assert grads.keys() == ref.keys() and len(ref) > 5
        bad = [k for k in ref if not torch.equal(grads[k], ref[k])]
        assert not bad, f"{policy}: {bad[:5]}"
        for c in calls:  # every region ran an even number of times: once in F, once in B per micro-batch
            assert c and all(v % 2 == 0 and v > 0 for v in c.values()), c
    return {p: out[p][2] for p in POLICIES}, {p: out[p][3] for p in POLICIES}


PIPELINE_SCHEDULES = ("zb-h1", "zbv", "dualpipe")


def _every_schedule(rank: int, world: int, kind: str) -> dict:
    """Every schedule of PIPELINE_SCHEDULES in one spawn (process start-up dominates a case)."""
    return {schedule: _pipeline_worker(rank, world, kind, schedule, 4) for schedule in PIPELINE_SCHEDULES}


@pytest.mark.parametrize("kind", MODELS)
def test_pipelines_with_recompute_give_bit_equal_gradients(kind):
    out = run_ranks(_every_schedule, 2, kind, timeout=400)
    for schedule in PIPELINE_SCHEDULES:
        res = [o[schedule] for o in out]
        peaks = [r[0] for r in res]
        print(f"\n{kind} {schedule} recorded activation peak bytes per rank: {peaks}")
        for p in peaks:
            assert p["selective"] < p["none"] and p["full"] < p["selective"], (schedule, p)
        if kind == "deepseek" and schedule == "dualpipe":  # DualPipe's overlapped F&B ran under every policy
            assert all(sum(r[1][p] for r in res) > 0 for p in POLICIES)


def test_deepseek_selective_keeps_the_latents_and_not_qkv():
    """MLA under "selective" keeps exactly: the block input, input_layernorm's normalised input and 1/rms, its
    output (the down-projections' input), the q latent, kv_a_proj_with_mqa's output (kv latent + rotary key) and
    the core's output (o_proj's input); q, k, v, RoPE's tables and the probabilities are recomputed from the
    latents in B."""
    from mt_dualpipe.models.deepseek_v3.model import Block

    config = deepseek_config()
    seq, fp32 = 16, 4
    kept_per_token = (3 * config.dim + 1 + config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim
                      + config.n_heads * config.v_head_dim)
    saved = {}
    for policy in ("none", "selective"):
        torch.manual_seed(0)
        block = Block(0, config)
        apply_recompute(block, policy)
        x = torch.randn(1, seq, config.dim, requires_grad=True)
        meter = SavedActivationMeter(exclude=list(block.parameters()))
        with meter.measure():
            block.attention(x).sum().backward()
        saved[policy] = meter.peak
        assert block.recompute_calls == ({} if policy == "none" else {"latent_attention": 2})
    assert saved["selective"] == kept_per_token * seq * fp32
    qkv = config.n_heads * (2 * (config.qk_nope_head_dim + config.qk_rope_head_dim) + config.v_head_dim)
    assert saved["none"] - saved["selective"] > qkv * seq * fp32  # at least q, k and v are no longer kept
