"""The real B/W split for models built from nn.Linear: ``DeferredLinear`` is bit-identical to
``nn.Linear`` and queues its weight-gradient GEMM while a ``WeightGradStore`` is active; which
stages take the fast split path; and a 2-rank zb-h1 pipeline whose W ops really run those GEMMs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe.runtime import DeferredLinear, WeightGradStore, defer_weight_grads
from mt_dualpipe.runtime.stage import supports_fast_split
from tests.helpers.dist import run_ranks

torch.set_num_threads(1)
H = 8


# ----- DeferredLinear == nn.Linear -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(37, 24), (3, 13, 24), (24, 2, 5, 24)], ids=["2d", "3d", "4d-strided"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("deferred", [True, False], ids=["store", "no-store"])
def test_deferred_linear_is_bit_identical_to_linear(dtype, shape, bias, deferred):
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=bias, dtype=dtype)
    lin = DeferredLinear.from_linear(copy.deepcopy(ref))
    store = WeightGradStore()
    for step in range(2):  # the second backward accumulates into existing .grad
        x = torch.randn(*shape, dtype=dtype)
        if len(shape) == 4:
            x = x.transpose(0, 2)  # non-contiguous input
        dy = torch.randn(*x.shape[:-1], 40, dtype=dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), lin(xb)
        assert torch.equal(ya, yb)
        ya.backward(dy)
        before = None if lin.weight.grad is None else lin.weight.grad.clone()
        if deferred:
            with store.deferring(step):
                yb.backward(dy)
            assert torch.equal(xa.grad, xb.grad)  # B: the input gradient only ...
            after_b = lin.weight.grad
            assert (after_b is None) if before is None else torch.equal(after_b, before)  # ... no weight grad yet
            assert store.run(step) == 1  # W: one closure (weight and bias)
        else:
            yb.backward(dy)
            assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(ref.weight.grad, lin.weight.grad)
        if bias:
            assert torch.equal(ref.bias.grad, lin.bias.grad)
    assert store.closures_run == (2 if deferred else 0) and len(store) == 0


def test_deferred_linear_respects_frozen_parameters_and_no_grad():
    lin = DeferredLinear(4, 3)
    lin.weight.requires_grad_(False)
    x = torch.randn(5, 4, requires_grad=True)
    store = WeightGradStore()
    with store.deferring("k"):
        lin(x).sum().backward()
    assert lin.weight.grad is None and x.grad is not None
    assert store.run("k") == 1 and lin.weight.grad is None and torch.equal(lin.bias.grad, torch.full((3,), 5.0))
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Scale(nn.Module):  # owns a parameter and declares nothing: an "expensive" owner
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return x * self.s


class CheapScale(Scale):
    cheap_weight_grad = True


def test_defer_weight_grads_swaps_exact_linears_keeping_parameters():
    model = nn.Sequential(Block(), nn.MultiheadAttention(H, 2), nn.Linear(H, H))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    assert defer_weight_grads(model, skip={"2"}) is model
    assert type(model[0].fc1) is DeferredLinear and type(model[0].fc2) is DeferredLinear
    assert type(model[2]) is nn.Linear  # skipped by name
    assert type(model[1].out_proj) is not DeferredLinear  # a Linear subclass with its own use: left alone
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == keys
    w = model[0].fc1.weight.detach().clone()
    model[0](torch.randn(3, H)).sum().backward()
    opt.step()  # the optimizer built before the swap still updates the swapped layers' weights
    assert not torch.equal(model[0].fc1.weight, w)
    with pytest.raises(TypeError, match="wrap a bare nn.Linear with DeferredLinear.from_linear"):
        defer_weight_grads(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not the string 'fc1'"):
        defer_weight_grads(Block(), skip="fc1")


@pytest.mark.parametrize("build, fast", [
    (lambda: nn.Sequential(nn.Linear(H, H)), False),                       # plain linear: generic split
    (lambda: defer_weight_grads(nn.Sequential(nn.Linear(H, H))), True),
    (lambda: defer_weight_grads(Block()), True),                           # + LayerNorm: cheap
    (lambda: defer_weight_grads(nn.Sequential(nn.Embedding(5, H), nn.RMSNorm(H), nn.Linear(H, H))), True),
    (lambda: defer_weight_grads(nn.Sequential(CheapScale(), nn.Linear(H, H))), True),  # declared cheap
    (lambda: defer_weight_grads(nn.Sequential(Scale(), nn.Linear(H, H))), False),      # expensive, undeclared
    (lambda: nn.Sequential(nn.LayerNorm(H), nn.Embedding(5, H)), False),  # only cheap owners: nothing for W
    (lambda: nn.Sequential(nn.ReLU()), False),                             # no parameters at all
])
def test_supports_fast_split_truth_table(build, fast):
    assert supports_fast_split(build()) is fast


# ----- a 2-rank zb-h1 pipeline ------------------------------------------------------------------------
def _stage(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    mod = nn.Sequential(Block(), Scale()) if kind == "mixed" else nn.Sequential(Block(), Block())
    return mod.double()


def _split_worker(rank, world, m):
    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime.stage import Stage

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * m, H, generator=g, dtype=torch.float64)
    y = torch.randn(2 * m, H, generator=g, dtype=torch.float64)
    out = {}
    for kind in ("plain", "deferred", "mixed"):
        layers = [_stage(kind, seed) for seed in range(world)]
        ref = copy.deepcopy(layers)
        losses = []
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            h = xm
            for layer in ref:
                h = layer(h)
            loss = F.mse_loss(h, ym)
            loss.backward()
            losses.append(loss.detach())
        mod = copy.deepcopy(layers[rank])
        if kind != "plain":
            defer_weight_grads(mod)
        pipe = Pipeline([mod], "zb-h1", timeout=30, fuse_backward=False)  # every W of the schedule runs as a W
        w_ops = []
        plain_weight = Stage.weight

        def counting_weight(self, mb, plain_weight=plain_weight, w_ops=w_ops):
            before = self.store.closures_run
            plain_weight(self, mb)
            w_ops.append(self.store.closures_run - before)

        Stage.weight = counting_weight
        try:
            loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=m, criterion=F.mse_loss,
                                labels=(y,) if rank == world - 1 else ())
        finally:
            Stage.weight = plain_weight
        grads_equal = all(torch.equal(p.grad, q.grad) for p, q in zip(mod.parameters(), ref[rank].parameters()))
        out[kind] = {"fast": next(iter(pipe.executor(m).stages.values())).fast, "w_ops": w_ops,
                     "grads_equal": grads_equal,
                     "max_diff": max((p.grad - q.grad).abs().max().item()
                                     for p, q in zip(mod.parameters(), ref[rank].parameters())),
                     "loss_equal": torch.equal(loss, torch.stack(losses)) if rank == world - 1 else loss is None}
    return out


@pytest.fixture(scope="module")
def zb_h1():
    return run_ranks(_split_worker, 2, 4, timeout=120)


def test_zb_h1_with_deferred_linears_equals_single_process(zb_h1):
    for rank, res in enumerate(zb_h1):
        for kind in ("plain", "deferred", "mixed"):
            assert res[kind]["loss_equal"], (rank, kind)
            assert res[kind]["grads_equal"], (rank, kind, res[kind]["max_diff"])  # bit for bit


def test_zb_h1_w_ops_run_the_deferred_gemms(zb_h1):
    for rank, res in enumerate(zb_h1):
        # 4 micro-batches, one W each; 4 linears per stage queue one closure each per B
        assert res["deferred"]["fast"] and res["deferred"]["w_ops"] == [4] * 4, (rank, res["deferred"])
        # an undeclared owner forces the generic path. Rank 1: its custom-function frontier makes B fall back
        # to a full backward, yet the 2 linears' GEMMs still wait for W. Rank 0: its inputs need no gradient,
        # so its whole backward runs at W (as autograd, nothing to queue)
        assert not res["mixed"]["fast"] and res["mixed"]["w_ops"] == [2 * rank] * 4, (rank, res["mixed"])
        # plain nn.Linear: the generic split, nothing queued in the store
        assert not res["plain"]["fast"] and res["plain"]["w_ops"] == [0] * 4, (rank, res["plain"])


def test_convert_to_fp8_converts_deferred_linears_and_keeps_skips():
    from mt_dualpipe.fp8 import FP8Linear, convert_to_fp8

    model = defer_weight_grads(nn.ModuleDict({"block": Block(), "head": nn.Linear(H, 4)}))
    weight = model["block"].fc1.weight
    convert_to_fp8(model, backend="emulated")
    assert type(model["block"].fc1) is FP8Linear and type(model["block"].fc2) is FP8Linear
    assert model["block"].fc1.weight is weight  # the same Parameter object
    assert type(model["head"]) is DeferredLinear  # skipped by name ("head"), still deferring
    assert supports_fast_split(model)
    with pytest.raises(TypeError, match="FP8Linear.from_linear"):
        convert_to_fp8(DeferredLinear(H, H))


class Boom(nn.Module):
    """A linear stage whose backward fails (a tensor hook raising, as a broken custom layer would)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        h = self.lin(x)
        h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        return h


@pytest.mark.parametrize("split, op", [(True, "B"), (False, "BW")])
def test_stage_errors_name_rank_op_stage_and_micro_batch(split, op):
    from mt_dualpipe.runtime.errors import PipelineError
    from mt_dualpipe.runtime.stage import Stage

    st = Stage(Boom(), chain=1, stage=2, is_first=False, is_last=False, store=WeightGradStore(), rank=3)
    x = torch.randn(2, H, requires_grad=True)
    st.forward(5, (x,), None, (), True, False)
    with pytest.raises(PipelineError, match=rf"^rank 3 {op}\(chain 1, stage 2, mb 5\) in Boom: RuntimeError: boom$") \
            as info:
        st.backward(5, [torch.ones(2, H)], split=split)
    assert str(info.value.__cause__) == "boom"
    last = Stage(nn.Linear(H, H), chain=0, stage=1, is_first=False, is_last=True, store=WeightGradStore())
    with pytest.raises(PipelineError, match=r"^F\(chain 0, stage 1, mb 0\) in Linear: the criterion was called without "
                                            r"labels and raised TypeError: .*; this rank holds the last stage 1 of "
                                            r"chain 0, so pass labels= to step\(\) here") as info:
        last.forward(0, (x,), F.mse_loss, (), True, False)
    assert isinstance(info.value.__cause__, TypeError)
