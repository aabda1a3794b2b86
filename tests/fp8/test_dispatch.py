"""FP8 dispatch (E4M3 rows + tile scales through the all-to-all, gradients in the model's dtype) and the FP8
caching of the expert up-projection input (one FP8 copy shared by w1 and w3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mt_dualpipe.fp8 import convert_to_fp8
from mt_dualpipe.fp8.quantize import dequantize, quantize_tiles
from mt_dualpipe.layers.expert_parallel import fp8_row_bytes, pack_fp8, unpack_fp8
from mt_dualpipe.layers.mlp import SwiGLUMLP
from mt_dualpipe.layers.moe import Dispatcher
from mt_dualpipe.layers.moe_state import moe_layers
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, build_stages
from mt_dualpipe.models.deepseek_v3.moe import moe_block
from tests.helpers.deepseek import overlapped_equals_sequential
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)


def small_config(**kw) -> DeepSeekV3Config:
    base = dict(dim=64, n_layers=3, vocab_size=64, inter_dim=64, moe_inter_dim=32, max_seq_len=32, mtp_depth=0,
                fp8_dispatch=True)
    return DeepSeekV3Config.preset("tiny", **{**base, **kw})


def test_packed_rows_are_the_tile_quantisation_and_about_half_of_bf16():
    x = torch.randn(4, 7168, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = pack_fp8(x)
    assert packed.dtype == torch.uint8 and packed.shape == (4, fp8_row_bytes(7168)) and fp8_row_bytes(7168) == 7392
    assert packed.nbytes / x.nbytes == 7392 / 14336  # 0.516: E4M3 values + one fp32 scale per 128
    assert torch.equal(unpack_fp8(packed, 7168, torch.float32), dequantize(quantize_tiles(x)))


def test_moe_dispatches_the_dequantised_fp8_rows():
    config = small_config()
    torch.manual_seed(0)
    moe = moe_block(config).eval()
    h = torch.randn(2, 8, config.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        flat = h.flatten(0, 1)
        routing = moe.gate(flat)
        plain_dispatch = Dispatcher(config.n_routed_experts)
        rows, plan = plain_dispatch.dispatch(flat, routing)
        rows = unpack_fp8(pack_fp8(rows), config.dim, rows.dtype)
        expected = plain_dispatch.combine(moe.experts.run(rows, plan.expert_rows), routing, plan)
        expected = expected.view(h.shape) + moe.shared_experts(h)
        assert torch.equal(moe(h), expected)
        plain = moe_block(config.replace(fp8_dispatch=False)).eval()
        plain.load_state_dict(moe.state_dict())
        assert not torch.equal(plain(h), expected)  # the dispatch really is quantised


def test_stages_with_fp8_dispatch_match_the_model_and_gradients_flow():
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    first, second = build_stages(config, 2, source=model, defer_weight_grads=False)
    second.criterion(second(first(tokens[:, :-1])), tokens[:, 1:]).backward()
    own = dict(model.named_parameters())
    n = 0
    for stage in (first, second):
        for name, p in stage.named_parameters():
            if p.grad is not None and name in own:
                torch.testing.assert_close(p.grad, own[name].grad, rtol=1e-5, atol=1e-6)
                n += 1
    assert n > 10 and all(m.dispatcher.fp8 for s in (first, second) for m in moe_layers(s))


def test_overlapped_forward_backward_with_fp8_dispatch_is_bit_identical():
    config = small_config()
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    g = torch.Generator().manual_seed(1)
    x0, x1 = (torch.randint(0, config.vocab_size, (2, 16), generator=g) for _ in range(2))
    y1 = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    assert overlapped_equals_sequential(config, model, x0, x1, y1)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_fp8_experts_keep_one_fp8_copy_of_their_input():
    torch.manual_seed(0)
    mlp = convert_to_fp8(torch.nn.Sequential(SwiGLUMLP(256, 128)), backend="emulated")[0]
    x = torch.randn(32, 256, requires_grad=True)
    shared = _saved_bytes(lambda: mlp(x))
    separate = _saved_bytes(lambda: mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    fp8_copy = 32 * 256 + 32 * 2 * 4  # E4M3 values + one fp32 scale per 1x128 tile
    assert separate - shared == fp8_copy
    assert torch.equal(mlp(x), mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def _ep_worker(rank, world):
    config = small_config()
    torch.manual_seed(0)
    full = moe_block(config)
    shard = moe_block(config, ep_group=dist.group.WORLD)
    shard.load_state_dict({k: v for k, v in full.state_dict().items() if k in shard.state_dict()})
    x = torch.randn(2 * world, 8, config.dim, generator=torch.Generator().manual_seed(1))
    rows = slice(2 * rank, 2 * rank + 2)
    x_loc = x[rows].clone().requires_grad_()
    y = shard(x_loc)
    y.sum().backward()
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.sum().backward()
    # fp32 sums run in another order on each side: the same tolerance for the output and its gradient
    torch.testing.assert_close(y, y_ref[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_loc.grad, x_ref.grad[rows], rtol=1e-5, atol=1e-6)
    return True


def test_fp8_dispatch_over_two_ep_ranks_matches_one_rank():
    assert run_ranks(_ep_worker, 2, timeout=180) == [True, True]


def _ep_overlap_worker(rank, world):
    """ep=2 with real non-blocking FP8 all-to-alls inside the overlapped F&B: bit-identical to F then B."""
    config = small_config(n_layers=2)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config)
    g = torch.Generator().manual_seed(10 + rank)
    x0, x1, y1 = (torch.randint(0, config.vocab_size, (2, 16), generator=g) for _ in range(3))
    return overlapped_equals_sequential(config, model, x0, x1, y1)


def test_overlapped_fp8_dispatch_over_two_ep_ranks():
    assert run_ranks(_ep_overlap_worker, 2, timeout=180) == [True, True]
