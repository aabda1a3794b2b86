"""Qwen3-MoE on the shared model layer against transformers' ``Qwen3MoeForCausalLM`` (float64, tiny config)."""

from __future__ import annotations

import json

import pytest
import torch

from mt_dualpipe.layers import SoftmaxTopKRouter, saved_elements_per_token, step_normalizer
from mt_dualpipe.models import from_pretrained
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, criterion_for, stages_for_rank
from mt_dualpipe.schedules import placements
from tests.helpers.dist import run_ranks
from tests.helpers.hf_reference import float64_transformers, randomize, recorded_reads, relative_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

# tests/models/conftest.py; kernels: two float paths compared, .ci/run repeats it on other CPU kernels
pytestmark = [pytest.mark.usefixtures("float64_qwen"), pytest.mark.kernels]


def hf_config(norm_topk: bool = True, **kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=norm_topk, decoder_sparse_step=1, mlp_only_layers=[2], max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager",
                experts_implementation="eager")
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_top_k_router_matches_transformers(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    with float64_transformers():
        ref = Qwen3MoeTopKRouter(hf_config(norm, num_experts=8, num_experts_per_tok=3)).double()
        torch.nn.init.normal_(ref.weight, generator=torch.Generator().manual_seed(0))
        x = torch.randn(20, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            _, want_w, want_i = ref(x)
    ours = SoftmaxTopKRouter(32, 8, 3, norm_topk_prob=norm).double()
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
    with torch.no_grad():
        got = ours(x)
    assert torch.equal(got.indices, want_i)
    assert relative_error(got.weights, want_w) < 1e-14
    assert torch.allclose(got.weights.sum(-1), torch.ones(20, dtype=torch.float64)) is norm


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("norm, sparse_step, yarn", [(True, 1, False), (False, 2, True)])
def test_transformers_checkpoint_gives_the_same_logits_and_back(tmp_path, norm, sparse_step, yarn):
    rope = {"rope_parameters": dict(YARN)} if yarn else {}
    with float64_transformers():
        torch.manual_seed(0)
        hf = transformers.Qwen3MoeForCausalLM(hf_config(norm, decoder_sparse_step=sparse_step, **rope)).double().eval()
        randomize(hf, 1)
        hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
        with torch.no_grad():
            ref = hf(tokens()).logits
    ours = from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    assert isinstance(ours, Qwen3MoeForCausalLM)
    c = ours.config
    assert (c.num_experts, c.norm_topk_prob, c.decoder_sparse_step, c.mlp_only_layers) == (4, norm, sparse_step, (2,))
    moe = [i for i in range(4) if c.is_moe_layer(i)]
    assert moe == ([0, 1, 3] if sparse_step == 1 else [1, 3])
    with torch.no_grad():
        err = relative_error(ours(tokens()), ref)
    print(f"qwen3_moe logits max relative error vs transformers (float64): {err:.3e}")
    assert err < 1e-12, err
    assert (c.rope.kind == "yarn") is yarn
    # ours -> transformers: the same logits; ours -> HF layout -> ours: bit-equal
    ours.save_pretrained(tmp_path / "ours", max_shard_size=20_000)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "qwen3_moe"
    with float64_transformers():
        again = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64,
                                                                 attn_implementation="eager",
                                                                 experts_implementation="eager").eval()
        assert again.config.num_experts == 4 and again.config.mlp_only_layers == [2]
        with torch.no_grad():
            assert relative_error(again(tokens()).logits, ref) < 1e-12
    back = from_pretrained(tmp_path / "ours", dtype=torch.float64)
    assert back.config == ours.config
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.fixture
def saved(tmp_path):
    config = Qwen3MoeConfig.preset("tiny")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    model.save_pretrained(tmp_path, max_shard_size=20_000)
    return config, model, tmp_path


@pytest.mark.parametrize("placement", ["v", "dual"])
def test_stages_read_only_their_tensors_and_match_the_model(saved, placement):
    config, model, path = saved
    place = placements.make_placement(placement, 2, 4)
    with recorded_reads() as read:
        by_rank = [stages_for_rank(config, place, r, checkpoint=path, dtype=torch.float64) for r in range(2)]
    every = [st for mods in by_rank for st in mods]
    assert sorted(read) == sorted(k for st in every for k in st.state_dict())
    stages = sorted({st.index: st for st in every}.values(), key=lambda st: st.index)
    x, y = tokens()[:, :-1] % config.vocab_size, tokens()[:, 1:] % config.vocab_size
    h = x
    for st in stages[:-1]:
        h = st(h)
    assert torch.equal(stages[-1].criterion(stages[-1](h), y), model(x, y))


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_policies_give_the_same_gradients(policy):
    from mt_dualpipe.models.qwen3_moe import build_stages

    config = Qwen3MoeConfig.preset("tiny")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    x, y = tokens()[:, :-1] % config.vocab_size, tokens()[:, 1:] % config.vocab_size
    grads = {}
    for pol in ("none", policy):
        (st,) = build_stages(config, 1, source=model, dtype=torch.float64, recompute=pol, defer_weight_grads=False)
        st.criterion(st(x), y).backward()
        grads[pol] = {n: p.grad for n, p in st.named_parameters()}
        if pol != "none":
            assert st.recompute_calls  # the regions ran (forward + recompute in backward)
    for n, g in grads["none"].items():
        assert torch.allclose(grads[policy][n], g, rtol=0, atol=1e-13), n
    layer = model.model.layers["1"]
    seq = 16
    assert (saved_elements_per_token(layer, "full", seq) < saved_elements_per_token(layer, "selective", seq)
            < saved_elements_per_token(layer, "none", seq))


# ----- 2 gloo ranks ------------------------------------------------------------------------------------------
NUM_MB = 4


def batch(config: Qwen3MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, config.vocab_size, (NUM_MB * 2, 9), generator=torch.Generator().manual_seed(7))
    return t[:, :-1], t[:, 1:]


def masked(y: torch.Tensor) -> torch.Tensor:
    """Labels whose micro-batches hold different numbers of ignored (-100) targets: 0, 3, 6 and 9."""
    y = y.clone()
    for m, part in enumerate(torch.tensor_split(y, NUM_MB)):  # views of y's rows
        part.view(-1)[: 3 * m] = -100
    return y


BALANCE = dict(output_router_logits=True, router_aux_loss_coef=0.1)


def _pipeline_worker(rank: int, world: int, schedule: str, policy: str, normalize: bool = False,
                     balance: bool = False) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.schedules.registry import build_schedule

    torch.set_num_threads(1)
    sched = build_schedule(schedule, world, NUM_MB)
    config = Qwen3MoeConfig.preset("tiny", **(BALANCE if balance else {}))
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    mods = stages_for_rank(config, sched, rank, source=model, dtype=torch.float64, recompute=policy)
    x, y = batch(config)
    criterion = criterion_for(mods)
    if normalize:  # every rank holds the whole batch here; a real loader would count its own labels
        y = masked(y)
        criterion = criterion_for(mods, normalizer=step_normalizer(y))
    pipe = Pipeline(mods, sched, timeout=120)
    pipe.record_activation_bytes = True  # the runtime's own peak of saved-activation bytes on this rank
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    pick = lambda t, c: torch.cat([torch.tensor_split(t, NUM_MB)[m] for m in sched.microbatches_of(c)])  # noqa: E731
    inputs = [pick(x, first[0])] if first else []
    labels = (pick(y, last[0]),) if last else ()
    pipe.step(*inputs, num_chunks=NUM_MB, criterion=criterion, labels=labels)
    grads = {n: p.grad.clone() for m in mods for n, p in m.named_parameters() if p.grad is not None}
    return {"grads": grads, "closures": pipe.store.closures_run, "peak_bytes": pipe.peak_activation_bytes}


def planned_peaks(config: Qwen3MoeConfig, schedule: str, policy: str) -> list[float]:
    """The planner's per-rank peak of saved-activation bytes for ``_pipeline_worker``'s run: the family's spec
    (the layers' declarations), float64, micro-batches of 2 x 8 tokens, one layer per stage of the V."""
    from mt_dualpipe.models.qwen3_moe.spec import planner_spec
    from mt_dualpipe.planner.estimate import planned_rank_peaks
    from mt_dualpipe.schedules.registry import build_schedule

    seq, rows = 8, 2
    items = planner_spec(config).items(seq, act_unit=8.0, recompute=policy, elem=8.0, micro_batch_size=rows)
    tokens = seq * rows
    return planned_rank_peaks(build_schedule(schedule, 2, NUM_MB), items, [1, 1, 1, 1], tokens,
                              config.hidden_size * 8.0 * tokens)


def test_the_step_normalizer_makes_pipelined_gradients_equal_the_whole_batch_token_mean():
    """Micro-batches with 0, 3, 6 and 9 ignored targets: with ``normalizer=step_normalizer(labels)`` the
    pipelined gradients equal one process's token mean over the whole batch; the per-micro-batch mean
    (summed over micro-batches, the default) does not."""
    config = Qwen3MoeConfig.preset("tiny")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    x, y = batch(config)
    y = masked(y)
    model(x, y).backward()  # one process, the whole batch: mean over its valid targets
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for xm, ym in zip(torch.tensor_split(x, NUM_MB), torch.tensor_split(y, NUM_MB)):
        model(xm, ym).backward()  # what the pipeline computes without a normalizer
    per_micro_batch = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got: dict[str, torch.Tensor] = {}
    for res in run_ranks(_pipeline_worker, 2, "zbv", "none", True, timeout=300):
        for n, g in res["grads"].items():
            got[n] = got[n] + g if n in got else g
    assert sorted(got) == sorted(want)
    assert max(relative_error(got[n], want[n]) for n in got) < 1e-12
    # even scaled to the token mean's size (averaged, not summed), the micro-batch means weigh each
    # micro-batch's targets by 1 / its own count: with uneven masks that is another gradient
    assert max(relative_error(per_micro_batch[n] / NUM_MB, want[n]) for n in want) > 1e-2


@pytest.mark.parametrize("schedule, policy, balance", [("zbv", "none", False), ("dualpipev", "none", True),
                                                       ("zbv", "selective", False)])
def test_pipeline_gradients_equal_one_process(schedule, policy, balance):
    """With ``balance`` the MoE layers' load-balancing losses (``output_router_logits``) inject their
    gradients on whichever stage the layer is: still equal to one process."""
    config = Qwen3MoeConfig.preset("tiny", **(BALANCE if balance else {}))
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double()
    x, y = batch(config)
    for xm, ym in zip(torch.tensor_split(x, NUM_MB), torch.tensor_split(y, NUM_MB)):
        model(xm, ym).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    results = run_ranks(_pipeline_worker, 2, schedule, policy, False, balance, timeout=300)
    for res in results:
        assert res["closures"] > 0  # weight gradients deferred to W (DeferredLinear)
        for n, g in res["grads"].items():
            got[n] = got[n] + g if n in got else g
    # the planner's peak of saved bytes per rank (the layers' declarations, the schedule's op order) against
    # the runtime's recorded peak
    recorded = [res["peak_bytes"] for res in results]
    planned = planned_peaks(config, schedule, policy)
    print(f"{schedule} ({policy}): recorded activation peaks {recorded}, planner {[round(p) for p in planned]}")
    assert all(p == pytest.approx(r, rel=0.10) for p, r in zip(planned, recorded)), (recorded, planned)
    assert sorted(got) == sorted(n for n, g in want.items() if g is not None)
    assert all(want[n].abs().max() > 0 for n in got)
    worst = max(relative_error(got[n], want[n]) for n in got)
    if balance:  # the balance losses changed the router's gradients: they did reach the pipeline's
        plain = Qwen3MoeForCausalLM(Qwen3MoeConfig.preset("tiny")).double()
        plain.load_state_dict(model.state_dict())
        for xm, ym in zip(torch.tensor_split(x, NUM_MB), torch.tensor_split(y, NUM_MB)):
            plain(xm, ym).backward()
        gate = "model.layers.1.mlp.gate.weight"
        assert relative_error(got[gate], plain.get_parameter(gate).grad) > 1e-3
    print(f"{schedule} ({policy}): worst per-parameter relative gradient difference vs one process: {worst:.3e}")
    assert worst < 1e-12, worst


def test_pipeline_save_round_trips(saved, tmp_path):
    from mt_dualpipe.models.qwen3_moe import build_stages, save_pipeline_checkpoint

    config, model, path = saved
    stages = build_stages(config, 3, checkpoint=path, dtype=torch.float64)
    out = save_pipeline_checkpoint(stages, tmp_path / "again")
    back = from_pretrained(out, dtype=torch.float64)
    assert back.config == config
    assert back.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


# ----- expert parallelism (2 gloo ranks, EP group = world) ------------------------------------------------
def _ep_worker(rank: int, world: int, path: str, policy: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with recorded_reads() as read:
        model = from_pretrained(path, dtype=torch.float64, ep_group=dist.group.WORLD)
    (stage,) = build_ep_stage(model, policy)
    x, y = batch(model.config)
    xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
    with torch.no_grad():
        out_logits = model(xr)
    stage.criterion(stage(xr), yr).backward()
    return {"read": read, "logits": out_logits, "experts": sorted(model.model.layers["1"].mlp.experts),
            "grads": {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}}


def build_ep_stage(model, policy):
    import torch.distributed as dist

    from mt_dualpipe.models.qwen3_moe import build_stages

    return build_stages(model.config, 1, source=model, dtype=torch.float64, recompute=policy,
                        defer_weight_grads=False, ep_group=dist.group.WORLD)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_expert_parallel_2_matches_one_process(saved, policy):
    config, model, path = saved
    x, y = batch(config)
    with torch.no_grad():
        want_logits = model(x)
    for xr, yr in zip(x.chunk(2), y.chunk(2)):
        model(xr, yr).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    results = run_ranks(_ep_worker, 2, str(path), policy, timeout=300)
    assert [r["experts"] for r in results] == [["0", "1"], ["2", "3"]]
    for rank, r in enumerate(results):  # each rank read its own experts and every dense tensor, once
        experts = {n for n in r["read"] if ".experts." in n}
        assert experts and all(int(n.split(".experts.")[1].split(".")[0]) // 2 == rank for n in experts)
        assert len(r["read"]) == len(set(r["read"]))
    assert relative_error(torch.cat([r["logits"] for r in results]), want_logits) < 1e-13
    got: dict[str, torch.Tensor] = {}
    for r in results:
        for n, g in r["grads"].items():
            got[n] = got[n] + g if n in got else g  # dense: summed over EP ranks; experts: one rank each
    assert sorted(got) == sorted(want)
    worst = max(relative_error(got[n], want[n]) for n in got)
    print(f"EP 2 ({policy}): worst relative gradient difference vs one process: {worst:.3e}")
    assert worst < 1e-12, worst


def test_30b_a3b_preset_and_planner_spec():
    from mt_dualpipe.models.qwen3_moe.spec import planner_spec

    config = Qwen3MoeConfig.preset("30b-a3b")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    assert model.num_parameters() == 30_532_122_624  # Qwen3-30B-A3B as published
    spec = planner_spec(config)
    qk_norms = config.num_hidden_layers * 2 * config.head_dim  # the one thing the planner leaves out
    assert spec.total_params() + qk_norms == model.num_parameters()
    assert 3.3e9 < spec.activated_params() < 3.4e9
    with pytest.raises(ValueError, match=r"dense layers are \[2\]"):
        planner_spec(config.replace(num_hidden_layers=4, mlp_only_layers=(2,)))


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_declared_saved_bytes_are_within_15_percent_of_what_autograd_keeps(moe, policy):
    from mt_dualpipe.models.qwen3_moe import Qwen3MoeDecoderLayer
    from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute

    config = Qwen3MoeConfig.preset("tiny", hidden_size=64, moe_intermediate_size=32, intermediate_size=96,
                                   num_experts=8, head_dim=16)
    torch.manual_seed(0)
    layer = Qwen3MoeDecoderLayer(config, 1 if moe else 0)
    assert config.is_moe_layer(1) and not config.is_moe_layer(0)
    apply_recompute(layer, policy)
    b, s = 2, 64
    x = torch.randn(b, s, 64, requires_grad=True)
    meter = SavedActivationMeter(exclude=list(layer.parameters()))
    with meter.measure():
        layer(x)
    declared = (saved_elements_per_token(layer, policy, s) + (64 if policy == "full" else 0)) * b * s * 4
    assert abs(declared / meter.peak - 1) < 0.15, (declared, meter.peak)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_planner_counts_what_the_layers_declare_and_autograd_keeps(moe, policy):
    """The planner's saved bytes per token of a Qwen3-MoE layer come from the modules' declarations
    (``spec.declared_saved``), not a separate description; against what autograd keeps (the meter),
    float32, sequence 64: within 10 %."""
    from mt_dualpipe.models.qwen3_moe import Qwen3MoeDecoderLayer
    from mt_dualpipe.models.qwen3_moe.spec import planner_spec
    from mt_dualpipe.models.recompute import SavedActivationMeter, apply_recompute

    config = Qwen3MoeConfig.preset("tiny", hidden_size=64, moe_intermediate_size=32, intermediate_size=96,
                                   num_experts=8, head_dim=16)
    b, s, index = 2, 64, 1 if moe else 0
    planned = planner_spec(config).layer_item(index, s, 4.0, policy, elem=4.0).act_bytes * b * s
    torch.manual_seed(0)
    layer = Qwen3MoeDecoderLayer(config, index)
    apply_recompute(layer, policy)
    x = torch.randn(b, s, 64, requires_grad=True)
    meter = SavedActivationMeter(exclude=list(layer.parameters()))
    with meter.measure():
        layer(x)
    print(f"{'moe' if moe else 'dense'} {policy}: planner {planned:.0f} B, autograd {meter.peak} B")
    assert abs(planned / meter.peak - 1) < 0.10, (planned, meter.peak)


def test_fp8_stages_convert_every_expert_and_train_close_to_bf16(saved):
    """``fp8=True``: attention, dense and expert linears become ``FP8Linear`` (router and head stay), from a
    source model or read from the checkpoint, and the loss is close to the unconverted one, not equal."""
    from mt_dualpipe.fp8 import FP8Linear
    from mt_dualpipe.models.qwen3_moe import build_stages

    config, model, path = saved
    model = model.float()
    x, y = batch(config)
    with torch.no_grad():
        ref = float(model(x, y))
    for kwargs in (dict(source=model), dict(checkpoint=path, dtype=torch.float32)):
        first, last = build_stages(config, 2, fp8=True, **kwargs)
        fp8 = {n for st in (first, last) for n, m in st.named_modules() if isinstance(m, FP8Linear)}
        assert any(".mlp.experts." in n for n in fp8) and any(".self_attn.q_proj" in n for n in fp8)
        assert not any(n.endswith(("lm_head", ".mlp.gate")) for n in fp8)
        loss = last.criterion(last(first(x)), y)
        loss.backward()
        value = loss.item()
        assert value != ref and abs(value - ref) < 0.02 * ref, (value, ref)
        assert all(p.grad is not None for p in first.parameters() if p.requires_grad)
