"""MoE experts whose weights are one 3-D tensor (transformers' Mixtral, Qwen2-MoE, ...) split into B and W.

Each expert multiplies by its slice ``w[e]``, so every expert's matrix product is a frontier node of the
generic split reaching the same weight. Their W runs as one engine call per shared weight
(``backward._weight_groups``): the weight gradients leave B, and equal one full backward bit for bit (each
expert's slice gets one contribution; the others add exact zeros). A weight left in B is named in a warning
that queued W work does not hide.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe.runtime import defer_weight_grads
from mt_dualpipe.runtime.backward import full_backward, split_backward
from mt_dualpipe.runtime.stage import Stage
from mt_dualpipe.runtime.weight_grad import WeightGradStore

H, INTER, EXPERTS, TOKENS = 8, 6, 4, 10


class GroupedExperts(nn.Module):
    """A router and experts held as 3-D weights, each expert running on its routed tokens (Mixtral's loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, EXPERTS, bias=False)
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, H) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, H, INTER) / INTER ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), -1).topk(2, -1)
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(x[token], self.gate_up[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return x + out


def _tokens(seed: int) -> torch.Tensor:
    return torch.randn(TOKENS, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_grouped_expert_weights_get_their_gradients_in_w_and_equal_a_full_backward():
    torch.manual_seed(0)
    mod = GroupedExperts().double()
    x, g = _tokens(1), _tokens(2)
    xr = x.clone().requires_grad_()
    full_in = full_backward([mod(xr)], [g], [xr])
    want = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    got_in, w = split_backward([mod(xs)], [g], [xs])
    assert all(p.grad is None for p in mod.parameters())  # B computed the input gradient only
    assert torch.equal(got_in[0], full_in[0])
    # one W engine call per weight: the router's product, and one per 3-D weight over all its experts
    assert w is not None and sorted(len(weights) for _, _, weights in w.calls) == [1, 1, 1]
    w.run()
    for n, p in mod.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_a_stage_of_grouped_experts_splits_without_a_warning():
    torch.manual_seed(0)
    stage = Stage(GroupedExperts().double(), 0, 1, False, False, WeightGradStore())
    ref = GroupedExperts().double()
    ref.load_state_dict(stage.module.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mb in range(2):
            x, g = _tokens(10 + mb), _tokens(20 + mb)
            stage.forward(mb, (x.clone().requires_grad_(),), None, (), True, False)
            stage.backward(mb, [g], split=True)
            assert stage.module.gate_up.grad is None or mb == 1
            stage.weight(mb)
            ref(x.clone().requires_grad_()).backward(g)
    for (n, p), q in zip(stage.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


class ReusedMatrixBesideLinear(nn.Module):
    """A deferring linear (queued for W) beside a matrix used twice on the input path (left in B)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.w = nn.Parameter(torch.randn(H, H) / H ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(self.proj(x)) @ self.w) @ self.w


def test_a_weight_left_in_b_is_named_even_when_other_work_is_queued_for_w():
    torch.manual_seed(0)
    stage = Stage(defer_weight_grads(ReusedMatrixBesideLinear().double()), 0, 1, False, False, WeightGradStore())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mb in range(2):
            stage.forward(mb, (_tokens(mb).requires_grad_(),), None, (), True, False)
            stage.backward(mb, [_tokens(5)], split=True)
            assert stage.module.proj.weight.grad is None or mb == 1  # the deferred linear's GEMM waits for W
            assert stage.store.queued((0, 1, mb))
            stage.weight(mb)
    said = [str(w.message) for w in seen if "ReusedMatrixBesideLinear" in str(w.message)]
    assert len(said) == 1, said  # once, though W had queued work each time
    assert said[0].startswith("stage (chain 0, stage 1) ReusedMatrixBesideLinear: the weight gradients of w are "
                              "computed in B, not W: the B/W split falls back to a full backward, since two of its "
                              "graph's nodes"), said[0]


def test_transformers_mixtral_experts_split_into_w():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).double()
    for p in block.parameters():
        nn.init.normal_(p, std=0.3)
    three_d = [n for n, p in block.named_parameters() if p.dim() == 3]
    assert three_d  # transformers keeps the experts as 3-D weights

    def run(x):
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    x, g = _tokens(3).view(2, TOKENS // 2, H), _tokens(4).view(2, TOKENS // 2, H)
    xr = x.clone().requires_grad_()
    full_backward([run(xr)], [g], [xr])
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    _, w = split_backward([run(xs)], [g], [xs])
    assert {n for n, p in block.named_parameters() if p.grad is not None} == set()
    w.run()
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0, msg=n)
