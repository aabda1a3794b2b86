"""AdamW with BF16 moments (formula, state bytes, checkpoint round trips, loss vs fp32 moments) and the
CPU EMA (formula, background update ordered before the next optimizer step, state round trip)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.optim import AdamWBF16, CpuEMA, optimizer_state_bytes

torch.set_num_threads(1)


def model_and_batches(steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    return model, [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(steps)]


def train(model, opt, batches):
    for x, y in batches:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_fp32_moments_are_bit_identical_to_torch_adamw():
    model, batches = model_and_batches(4)
    ref = copy.deepcopy(model)
    train(model, AdamWBF16(model.parameters(), lr=1e-2, weight_decay=0.1, moment_dtype=torch.float32), batches)
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), batches)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_bf16_moments_are_the_rounded_fp32_update():
    # One step from zero moments: m = (1-β1)·g and v = (1-β2)·g², each rounded to bf16.
    model, batches = model_and_batches(1)
    opt = AdamWBF16(model.parameters(), lr=1e-2)
    train(model, opt, batches)  # zero_grad set grads to None: recompute g
    ref, _ = model_and_batches(1)
    x, y = batches[0]
    ((ref(x) - y) ** 2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        st = opt.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(st["exp_avg"], (0.1 * q.grad).to(torch.bfloat16))
        assert torch.equal(st["exp_avg_sq"], (0.001 * q.grad * q.grad).to(torch.bfloat16))


def test_state_bytes_per_parameter_halve():
    model, batches = model_and_batches(1)
    n = sum(p.numel() for p in model.parameters())
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(model)
        opt = AdamWBF16(m.parameters(), moment_dtype=dtype)
        train(m, opt, batches)
        sizes[dtype] = optimizer_state_bytes(opt) - 4 * len(opt.state)  # less the float32 step counters
    assert sizes[torch.float32] == 8 * n and sizes[torch.bfloat16] == 4 * n


def _resume(state_io, steps_before=2, steps_after=2):
    model, batches = model_and_batches(steps_before + steps_after)
    straight = copy.deepcopy(model)
    train(straight, AdamWBF16(straight.parameters(), lr=1e-2), batches)
    opt = AdamWBF16(model.parameters(), lr=1e-2)
    train(model, opt, batches[:steps_before])
    resumed_model = copy.deepcopy(model)
    resumed = AdamWBF16(resumed_model.parameters(), lr=1e-2)
    state_io(model, opt, resumed_model, resumed)
    for s in resumed.state.values():
        assert s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
    for p, q in zip(opt.state.values(), resumed.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
    train(resumed_model, resumed, batches[steps_before:])
    for a, b in zip(resumed_model.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def test_state_dict_round_trips_through_torch_save(tmp_path):
    def io(model, opt, resumed_model, resumed):
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
        resumed.load_state_dict(torch.load(tmp_path / "opt.pt"))

    _resume(io)


def test_state_dict_round_trips_through_dcp(tmp_path):
    def io(model, opt, resumed_model, resumed):
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "dcp"))
        train(resumed_model, resumed, model_and_batches(1)[1])  # materialise a state to load into
        template = {"optim": get_optimizer_state_dict(resumed_model, resumed)}
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
        set_optimizer_state_dict(resumed_model, resumed, template["optim"])
        with torch.no_grad():
            for a, b in zip(resumed_model.parameters(), model.parameters()):
                a.copy_(b)

    _resume(io)


def test_bf16_moments_loss_within_half_a_percent_on_the_tiny_deepseek():
    config = DeepSeekV3Config.preset("tiny", dim=64, inter_dim=128, moe_inter_dim=32, vocab_size=128, n_layers=2,
                                     mtp_depth=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, 33), generator=g) for _ in range(4)]
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = DeepSeekV3Model(config)
        opt = AdamWBF16(model.parameters(), lr=1e-3, moment_dtype=dtype)
        run = []
        for step in range(12):
            t = batches[step % len(batches)]
            loss = model(t[:, :-1], t[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(float(loss.detach()))
        losses[dtype] = run
    assert losses[torch.float32][-1] < losses[torch.float32][0] - 0.1  # it learns (4 batches, repeated)
    for a, b in zip(losses[torch.float32], losses[torch.bfloat16]):
        assert abs(a - b) / a < 0.005


def test_cpu_ema_follows_the_formula_and_waits_before_the_next_step():
    model, batches = model_and_batches(3)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = CpuEMA(model, decay=0.5, optimizer=opt)
    expected = start
    for x, y in batches:
        ((model(x) - y) ** 2).mean().backward()
        opt.step()  # the pre-hook waits for the previous update before the parameters change
        opt.zero_grad()
        job = ema.update()
        assert job is ema.pending
        expected = [0.5 * e + 0.5 * p.detach() for e, p in zip(expected, model.parameters())]
    state = ema.state_dict()
    assert state["updates"] == 3 and ema.pending is None
    for e, n in zip(expected, ema.names):
        torch.testing.assert_close(state["params"][n], e, rtol=0, atol=1e-7)
    other = CpuEMA(copy.deepcopy(model), decay=0.9)
    other.load_state_dict(state)
    target = copy.deepcopy(model)
    other.copy_to(target)
    for e, p in zip(expected, target.parameters()):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)
    ema.close()
    other.close()
    with pytest.raises(ValueError, match=r"EMA decay must be in \[0, 1\), got 1.0"):
        CpuEMA(model, decay=1.0)
