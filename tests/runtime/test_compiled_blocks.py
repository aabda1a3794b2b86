"""``torch.compile``'d blocks under the split schedules, with nothing asked of the user.

A stage's compiled regions trace their linears as ``mt_dualpipe::linear`` (``runtime/linear_op.py``),
so a region stays one graph, the weight-gradient GEMMs still run in W, each compiled backward runs
once (counted by a backend that wraps AOTAutograd's backward), the gradients equal eager, buffer
donation is off (torch's own pipelining crashes on it under ZB-V and DualPipeV), and a second step
compiles nothing new.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.runtime import compiled
from mt_dualpipe.runtime.stage import Stage
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from mt_dualpipe.schedules import build_schedule
from tests.helpers.dist import run_ranks
from tests.helpers.models import H, chain_batch, check_against_reference, criterion, make_data, reference

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev", "dualpipe")
M = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.a, self.b = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def counting_backend() -> tuple:
    """aot_eager whose compiled backward counts its calls."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    calls = {"forward": 0, "backward": 0, "graphs": 0}

    def fw(gm, example_inputs):
        calls["graphs"] += 1

        def run(*args):
            calls["forward"] += 1
            return gm.forward(*args)
        return make_boxed_func(run)

    def bw(gm, example_inputs):
        def run(*args):
            calls["backward"] += 1
            return gm.forward(*args)
        return make_boxed_func(run)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw), calls


def compile_blocks(stage: nn.Module, how: str, backend) -> nn.Module:
    """The user's compile: each block (``module.compile()``, torchtitan's way) or the whole stage."""
    if how == "blocks":
        for b in stage.blocks:
            b.compile(backend=backend)
        return stage
    return torch.compile(stage, backend=backend)


@pytest.mark.parametrize("how", ["blocks", "stage"])
def test_weight_gemms_run_in_w_and_each_compiled_backward_once(how):
    torch.manual_seed(0)
    eager = TwoBlocks().double()
    backend, calls = counting_backend()
    mod = compile_blocks(copy.deepcopy(eager), how, backend)
    stage = Stage(mod, 0, 1, False, False, WeightGradStore())
    linears = [m.weight for m in mod.modules() if isinstance(m, nn.Linear)]
    norms = [m.weight for m in mod.modules() if isinstance(m, nn.LayerNorm)]
    g = torch.randn(3, H, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "split is empty" warning
        for mb in range(2):
            x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(mb))
            forwards = calls["forward"]
            stage.forward(mb, (x.requires_grad_(),), None, (), True, False)
            forwards = calls["forward"] - forwards
            before = calls["backward"]
            stage.backward(mb, [g], split=True)
            pieces = calls["backward"] - before
            assert all(w.grad is None for w in linears + norms) if mb == 0 else True  # nothing accumulated in B
            queued = stage.store.closures_run
            stage.weight(mb)
            assert stage.store.closures_run - queued == 4, "W ran the four linears' weight GEMMs"
            assert calls["backward"] == before + pieces  # W re-ran no compiled backward
            eager(x.detach().clone().requires_grad_()).backward(g)
    regions = 2 if how == "blocks" else 1
    assert pieces == forwards == regions  # one graph per compiled region (no break at the linears), backward once
    assert calls["graphs"] == 1  # the blocks share one graph, as they do without the split
    assert torch.allclose(stage.input_grads[1][0], _input_grad(eager, 1, g), rtol=0, atol=1e-13)
    for p, r in zip(mod.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=0, atol=1e-13)


def _input_grad(eager: nn.Module, mb: int, g: torch.Tensor) -> torch.Tensor:
    x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(mb)).requires_grad_()
    copy.deepcopy(eager)(x).backward(g)
    return x.grad


def test_the_linears_of_compiled_regions_are_kept_eager_once():
    mod = compile_blocks(TwoBlocks(), "blocks", "aot_eager")
    assert compiled.split_products(mod) == 4
    assert compiled.split_products(mod) == 0  # already done: nothing wrapped twice
    assert compiled.split_products(TwoBlocks()) == 0  # nothing compiled, nothing touched


def _worker(rank: int, world: int, cases: list) -> list[dict]:
    import torch._dynamo

    from mt_dualpipe import Pipeline
    from mt_dualpipe.runtime import defer_weight_grads

    torch.set_num_threads(1)
    got = []
    for sched, how, defer, layers, x, labels, *inductor in cases:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        backend, calls = ("inductor", {}) if inductor else counting_backend()
        local = sched.local_stages(rank)
        mods = [copy.deepcopy(layers[s]) for _, s in local]
        if defer:
            mods = [defer_weight_grads(m) for m in mods]
        mods = [compile_blocks(m, how, backend) for m in mods]
        pipe = Pipeline(mods, sched, timeout=60)
        m = sched.num_microbatches
        first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
        last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
        inp = (chain_batch(sched, first[0], x, m),) if first else ()
        lab = (chain_batch(sched, last[0], labels, m),) if last else ()
        loss, outs = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
        result = {"local": local, "loss": loss, "outputs": outs, "chain_end": last,
                  "grads": [[p.grad.clone() for p in mod.parameters()] for mod in mods],
                  "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                  "forward": calls.get("forward"), "backward": calls.get("backward")}
        pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab)
        result["graphs_after_second_step"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got.append(result)
    return got


VARIANTS = (("blocks", False), ("blocks", True), ("stage", False))
"""How the user compiles (each block, or the whole stage) and whether the linears defer their weight GEMMs."""
EVERY_VARIANT = ("zbv", "dualpipev")
"""The schedules that run every variant by default (two stages per rank); the others run the first by default
and the other two in the slow tier: a variant changes what a stage compiles, not what the schedule does."""


@functools.cache
def _results(rest: bool) -> tuple[list, list]:
    """The default cases (``rest`` False) or the slow tier's."""
    cases = []
    for name in SCHEDULES:
        variants = VARIANTS if name in EVERY_VARIANT else VARIANTS[:1]
        if rest:
            variants = () if name in EVERY_VARIANT else VARIANTS[1:]
        sched = build_schedule(name, 2, M)
        torch.manual_seed(len(cases))
        layers = [TwoBlocks().double() for _ in range(len(sched.placement[0]))]
        x, labels = make_data(M, seed=5)
        cases += [(sched, how, defer, layers, x, labels) for how, defer in variants]
    per_rank = run_ranks(_worker, 2, cases, timeout=300)
    return cases, [[per_rank[r][i] for r in range(2)] for i in range(len(cases))]


@pytest.mark.parametrize("name", SCHEDULES)
def test_compiled_blocks_match_eager_and_compile_once(name):
    _check(name, *_results(False))


@pytest.mark.slow  # the other variants on the schedules with one stage per rank
@pytest.mark.parametrize("name", [n for n in SCHEDULES if n not in EVERY_VARIANT])
def test_the_other_variants_on_one_stage_per_rank(name):
    _check(name, *_results(True))


def _check(name: str, cases: list, results: list) -> None:
    for (sched, how, defer, layers, x, labels), res in zip(cases, results):
        if sched.name != name:
            continue
        check_against_reference(sched, res, [copy.deepcopy(m) for m in layers], x, labels)
        for r in res:
            assert r["graphs_after_second_step"] == r["graphs"], (name, how, defer)  # no recompilation
            assert r["backward"] == r["forward"] > 0, (name, how, defer)  # each compiled backward ran once


@pytest.mark.slow
def test_inductor_compiled_blocks_match_eager_under_zbv_and_dualpipev():
    """The same with inductor (its first compile takes tens of seconds on CPU)."""
    cases = []
    for name in ("zbv", "dualpipev"):
        sched = build_schedule(name, 2, M)
        torch.manual_seed(7)
        layers = [TwoBlocks().double() for _ in range(len(sched.placement[0]))]
        x, labels = make_data(M, seed=5)
        cases.append((sched, "blocks", False, layers, x, labels, "inductor"))
    per_rank = run_ranks(_worker, 2, cases, timeout=600)
    for i, (sched, _, _, layers, x, labels, _) in enumerate(cases):
        res = [per_rank[r][i] for r in range(2)]
        ref_loss, _, ref_grads = reference([copy.deepcopy(m) for m in layers], x, labels, M)
        for r in res:  # inductor fuses in another order than eager: equal within float64 rounding
            for c in r["chain_end"]:
                assert torch.allclose(r["loss"], ref_loss[sched.microbatches_of(c)], rtol=1e-12, atol=0)
            for (_, s), grads in zip(r["local"], r["grads"]):
                for g, want in zip(grads, ref_grads[s]):
                    assert torch.allclose(g, want, rtol=1e-10, atol=1e-13), (sched.name, s)
            assert r["graphs_after_second_step"] == r["graphs"] > 0


def test_a_split_linear_outside_a_pipeline_accumulates_once_and_fires_its_hook_once():
    """With no store active (a fused BW, or no pipeline) the op's backward accumulates at once: the
    gradients equal eager's, and a post-accumulate hook fires once per backward (the compiled node has
    no autograd edge to the weight, so autograd does not run its AccumulateGrad empty-handed)."""
    torch.manual_seed(0)
    eager = TwoBlocks().double()
    mod = compile_blocks(copy.deepcopy(eager), "blocks", "aot_eager")
    assert compiled.split_products(mod) == 4
    fired: list[int] = []
    mod.blocks[0].a.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    for seed in range(2):
        x = torch.randn(3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        mod(x.clone().requires_grad_()).sum().backward()
        eager(x.clone().requires_grad_()).sum().backward()
    assert fired == [1, 1]
    for p, r in zip(mod.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-13)
