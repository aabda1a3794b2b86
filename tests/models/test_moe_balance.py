"""The shared layer's MoE routing and balancing: transformers' load-balancing loss for softmax routers
(Qwen3-MoE's ``output_router_logits``), and DeepSeek-V3's MoE as ``layers.MoEBlock`` with its
sigmoid group-limited router, against transformers' ``DeepseekV3MoE``."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.layers import GroupLimitedRouter, MoEBlock, SoftmaxTopKRouter
from mt_dualpipe.layers.balance import switch_balance_loss
from mt_dualpipe.layers.router import group_limited_topk
from mt_dualpipe.models import from_pretrained
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config
from mt_dualpipe.models.deepseek_v3.moe import moe_block
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from tests.helpers.hf_reference import float64_transformers, randomize, relative_error

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("float64_qwen")  # tests/models/conftest.py


def hf_config(**kw):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager",
                experts_implementation="eager", output_router_logits=True, router_aux_loss_coef=0.3)
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and our labels (target of position i = token i+1; the last position has none, -100), whose
    transformers equivalent is ``labels=inputs`` (transformers shifts them itself)."""
    t = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(5))
    y = t[:, 1:].clone()
    y[:, -1] = -100
    return t[:, :-1], y


def hf_grads_as_ours(ours, hf):
    """(our gradient, transformers') pairs for every parameter; transformers 5 keeps a layer's experts
    fused (``experts.gate_up_proj`` (E, 2I, H): gate rows then up rows; ``experts.down_proj`` (E, H, I))."""
    theirs = dict(hf.named_parameters())
    pairs = []
    for name, p in ours.named_parameters():
        if ".experts." not in name:
            pairs.append((p.grad, theirs[name].grad))
            continue
        prefix, rest = name.split(".experts.")
        e, proj = int(rest.split(".")[0]), rest.split(".")[1]
        inter = p.shape[0] if proj != "down_proj" else p.shape[1]
        fused = theirs[f"{prefix}.experts.gate_up_proj"].grad[e]
        want = {"gate_proj": fused[:inter], "up_proj": fused[inter:],
                "down_proj": theirs[f"{prefix}.experts.down_proj"].grad[e]}[proj]
        pairs.append((p.grad, want))
    return pairs


def test_switch_loss_equals_transformers_load_balancing_loss_on_one_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    got = switch_balance_loss(probs, probs.topk(3, dim=-1).indices)
    with float64_transformers():
        want = load_balancing_loss_func((logits,), 8, 3)
    assert relative_error(got, want) < 1e-6  # transformers sums in float32 (histc, .float()) by design
    # perfectly balanced routing with uniform probabilities gives K (= 3): N * sum_i (K/N) * (1/N)
    uniform = torch.full((8, 8), 1 / 8, dtype=torch.float64)
    idx = torch.stack([torch.arange(3) + i for i in range(8)]) % 8
    assert switch_balance_loss(uniform, idx).item() == pytest.approx(3.0, rel=1e-12)


def test_qwen3_balance_loss_value_and_gradients_equal_transformers(tmp_path):
    """One MoE layer (transformers concatenates the layers' router logits before averaging, which for
    one layer is the per-layer loss): the training loss value and every parameter's gradient equal
    transformers' ``Qwen3MoeForCausalLM(output_router_logits=True)``."""
    x, y = tokens()
    with float64_transformers():
        torch.manual_seed(0)
        hf = transformers.Qwen3MoeForCausalLM(hf_config()).double().train()
        randomize(hf, 1)
        hf.save_pretrained(tmp_path)
        out = hf(x, labels=x)  # transformers shifts the labels itself
        out.loss.backward()
    ours = from_pretrained(tmp_path, dtype=torch.float64).train()
    assert (ours.config.output_router_logits, ours.config.balance_coef) == (True, 0.3)
    loss = ours(x, y)
    assert out.aux_loss.item() > 0.5  # the balance term is a real part of the loss being compared
    # transformers computes the balance loss in float32 (its histc counts and probability sums): 1e-6
    assert relative_error(loss, out.loss) < 1e-6
    loss.backward()
    assert max(relative_error(g, w) for g, w in hf_grads_as_ours(ours, hf)) < 1e-6
    # without the switch, the router's gradient is another one
    plain = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_hf(hf_config().to_dict(), output_router_logits=False)).double()
    plain.load_state_dict(ours.state_dict())
    plain(x, y).backward()
    gate = "model.layers.0.mlp.gate.weight"
    assert relative_error(plain.get_parameter(gate).grad, ours.get_parameter(gate).grad) > 1e-3


def test_several_moe_layers_average_their_per_layer_losses(tmp_path):
    """Each MoE layer weighs its own loss by coef / (MoE layers): the loss is the LM loss plus the
    coefficient times the mean of transformers' loss applied to each layer's logits alone."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    x, y = tokens()
    with float64_transformers():
        torch.manual_seed(0)
        hf = transformers.Qwen3MoeForCausalLM(hf_config(num_hidden_layers=3, mlp_only_layers=[])).double().train()
        randomize(hf, 2)
        hf.save_pretrained(tmp_path)
        out = hf(x, labels=x)
        per_layer = [load_balancing_loss_func((lg,), 6, 2) for lg in out.router_logits]
    ours = from_pretrained(tmp_path, dtype=torch.float64).train()
    config = ours.config
    lm = out.loss - 0.3 * out.aux_loss
    want = lm + 0.3 * torch.stack(per_layer).mean()
    assert config.balance_coef == pytest.approx(0.1)
    assert relative_error(ours(x, y), want) < 1e-6
    assert abs(torch.stack(per_layer).mean() - out.aux_loss) > 1e-6  # the two conventions do differ here


def test_deepseek_v3s_moe_block_equals_transformers_deepseek_v3_moe():
    """DeepSeek-V3's MoE is the shared ``MoEBlock`` with a ``GroupLimitedRouter`` (sigmoid, bias, 4 groups of
    which 2 kept, route scale 2.5, one shared expert): the same expert ids and output as transformers'
    ``DeepseekV3MoE`` with the same weights (float64)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepSeekV3Config.preset("tiny")
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in config.to_hf().items() if k != "quantization_config"},
                                           experts_implementation="eager")
    torch.manual_seed(0)
    ours = moe_block(config).double().eval()
    assert isinstance(ours, MoEBlock) and isinstance(ours.gate, GroupLimitedRouter)
    with torch.no_grad():
        for p in ours.parameters():
            torch.nn.init.normal_(p, 0.0, 0.05)
        ours.gate.e_score_correction_bias.copy_(torch.randn(16, dtype=torch.float64) * 0.1)
    with float64_transformers():
        hf = DeepseekV3MoE(hf_cfg).double().eval()
        with torch.no_grad():
            hf.gate.weight.copy_(ours.gate.weight)
            hf.gate.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(hf.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight)
            for i, expert in ours.experts.items():
                hf.experts.gate_up_proj[int(i)].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
                hf.experts.down_proj[int(i)].copy_(expert.down_proj.weight)
        h = torch.randn(3, 10, config.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            _, _, want_ids = hf.gate(h)
            want = hf(h)
    with torch.no_grad():
        got = ours.gate(h.flatten(0, 1))
        assert torch.equal(got.indices.sort(-1).values, want_ids.sort(-1).values)
        assert max(len(set(r.tolist())) for r in got.indices // 4) <= 2  # only 2 of the 4 groups per token
        assert relative_error(ours(h), want) < 1e-12


def test_group_limited_topk_keeps_the_best_groups_and_refuses_an_unknown_score():
    choice = torch.tensor([[0.9, 0.2, 0.5, 0.5, 0.0, 0.8, 0.2, 0.2]])  # groups of 2: top2 sums 1.1, 1.0, 0.8, 0.4
    assert sorted(group_limited_topk(choice, 2, 4, 1, "top2").tolist()[0]) == [0, 1]
    assert sorted(group_limited_topk(choice, 3, 4, 2, "top2").tolist()[0]) == [0, 2, 3]  # groups 0 and 1
    assert sorted(group_limited_topk(choice, 3, 4, 2, "max").tolist()[0]) == [0, 1, 5]  # maxes .9 .5 .8 .2
    with pytest.raises(ValueError, match="group_score must be 'top2' or 'max'"):
        group_limited_topk(choice, 2, 4, 1, "sum")
    with pytest.raises(ValueError, match=r"n_group \(3\) must divide n_routed_experts \(8\)"):
        GroupLimitedRouter(4, 8, 2, n_groups=3)


def test_balance_loss_is_off_by_default_and_in_evaluation():
    router = SoftmaxTopKRouter(16, 4, 2)
    torch.nn.init.normal_(router.weight)
    block = MoEBlock(16, 8, router, balance_coef=0.5)
    x = torch.randn(2, 3, 16)
    block.eval()
    block(x)
    assert block.last_balance_loss is None
    block.train()
    block(x)
    assert block.last_balance_loss is not None and block.last_balance_loss.item() > 0
    assert Qwen3MoeConfig.preset("tiny").balance_coef == 0.0
