"""``build_stages(..., compile=...)``: DeepSeek-V3 and Llama stages compiled per block for the B/W split.

Compiled against eager, on the runtime's own split (B queues, W runs): gradients bit-identical, the same
number of weight-gradient closures run in W (none of the deferred linears' weight gradients exists
after B), each recompute region still runs once in F and once in B, and a second step compiles no
new graph.

Why bit-identical, on any CPU's kernels (``ATEN_CPU_CAPABILITY``), FP8 included: ``aot_eager`` runs the
graphs' ATen ops with the eager kernels, in the eager order; the FP8 quantiser is one opaque op in a
graph (``fp8/quantize.py``), so its max-abs, division and E4M3 cast are the eager ones; and an RMSNorm's
input gradient reaches the residual stream as one sum, compiled or not (``layers/norm.py``). Without
that last point the engine added the norm's two shares and the residual's in another order than a
compiled norm does: a one-ulp difference that the next FP8 linear's backward turned into a whole E4M3
step of its output gradient (1/8 of an element) wherever ``dy / scale`` lay on a rounding boundary,
which depended on the CPU's vector kernels. ``inductor`` generates kernels of its own; its float64 case
is compared within float rounding. On 2 gloo ranks: DeepSeek-V3 under DualPipe (its overlapped F&B
runs the compiled blocks) and Llama under ZB-V. ``aot_eager`` keeps the compile time of these cases
short (it runs the same AOTAutograd graphs inductor would compile); the benchmark
(``benchmarks/compile_step.py``) runs inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

from mt_dualpipe.fp8 import convert_to_fp8
from mt_dualpipe.models.compile import check_backend, compiled_targets
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model
from mt_dualpipe.models.deepseek_v3 import build_stages as deepseek_stages
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM
from mt_dualpipe.models.llama.stages import build_stages as llama_stages
from mt_dualpipe.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from mt_dualpipe.models.qwen3_moe import build_stages as qwen3_stages
from mt_dualpipe.runtime.stage import Stage
from mt_dualpipe.runtime.weight_grad import WeightGradStore
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

torch.set_num_threads(1)
BACKEND = "aot_eager"


def deepseek_config() -> DeepSeekV3Config:
    return DeepSeekV3Config.preset("tiny", dim=64, n_layers=3, vocab_size=64, inter_dim=128, moe_inter_dim=32,
                                   max_seq_len=64, mtp_depth=1)


def llama_config(layers: int = 2) -> LlamaConfig:
    return LlamaConfig.preset("tiny", num_hidden_layers=layers, vocab_size=64)


def make(kind: str, num_stages: int = 1, **kwargs):
    """(config, reference model, stage builder) of a family, float64 unless FP8 is asked; dynamo's caches
    emptied, so the graphs a case compiles are its own."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    family = {"deepseek": (deepseek_config, DeepSeekV3Model, deepseek_stages),
              "llama": (llama_config, LlamaForCausalLM, llama_stages),
              "qwen3": (lambda: Qwen3MoeConfig.preset("tiny", num_hidden_layers=2, mlp_only_layers=(0,),
                                                      vocab_size=64), Qwen3MoeForCausalLM, qwen3_stages)}
    make_config, model_class, build = family[kind]
    config = make_config()
    model = model_class(config)
    if not kwargs.get("fp8"):
        model = model.double()

    def stages(compile: bool | str = False):
        built = build(config, num_stages, source=model, compile=compile, **kwargs)
        return [st.double() for st in built] if not kwargs.get("fp8") else built
    return config, stages


def deferred_weights(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.weight": m.weight for name, m in stage.named_modules()
            if getattr(type(m), "supports_deferred_weight_grad", False)}


def split_steps(stage_module: torch.nn.Module, vocab: int, steps: int = 2, mbs: int = 2) -> dict:
    """``steps`` zero-bubble steps of one whole-model stage on the runtime's Stage: all F, all B, then all W."""
    stage = Stage(stage_module, 0, 0, True, True, WeightGradStore())
    graphs, early = [], set()
    for step in range(steps):
        graphs.append(counters["stats"]["unique_graphs"])
        for mb in range(mbs):
            t = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(mb))
            stage.forward(mb, (t[:, :-1],), stage_module.criterion, (t[:, 1:],), True, False)
        for mb in range(mbs):
            stage.backward(mb, None, split=True)
        if step == 0:  # the deferring linears whose weight gradient B computed (Llama's head: used by F.linear)
            early = {n for n, w in deferred_weights(stage_module).items() if w.grad is not None}
        for mb in range(mbs):
            stage.weight(mb)
    graphs.append(counters["stats"]["unique_graphs"])
    return {"closures": stage.store.closures_run, "graphs": graphs, "early": early,
            "calls": dict(stage_module.recompute_calls),
            "grads": {n: p.grad for n, p in stage_module.named_parameters() if p.grad is not None}}


def assert_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys() and len(want) > 5
    worst = {k: (got[k] - want[k]).abs().max().item() for k in want}
    bad = {k: v for k, v in worst.items() if v > atol * max(1.0, want[k].abs().max().item())}
    assert not bad, bad


def assert_equal(got: dict, want: dict) -> None:
    """Bit-identical gradients (the module docstring says why ``aot_eager`` gives them)."""
    assert got.keys() == want.keys() and len(want) > 5
    bad = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not bad, bad


@pytest.mark.parametrize("kind", ["deepseek", "llama", "qwen3"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_compiled_stage_matches_eager_with_weight_gemms_in_w(kind, policy):
    config, stages = make(kind, recompute=policy)
    (eager,) = stages()
    (compiled,) = stages(BACKEND)
    assert compiled_targets(compiled) and not compiled_targets(eager)
    want = split_steps(eager, config.vocab_size)
    got = split_steps(compiled, config.vocab_size)
    assert_equal(got["grads"], want["grads"])
    assert got["closures"] == want["closures"] > 0  # every weight GEMM ran in W, none went into a graph
    assert got["early"] == want["early"] and len(want["early"]) <= 1  # and none of them ran in B
    assert got["calls"] == want["calls"]  # each recompute region: once in F, once in B, as in eager
    first, second, end = got["graphs"]
    assert second > first and end == second  # compiled at the first step, nothing new at the second


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek", "llama"])
def test_inductor_compiled_stage_matches_eager(kind):
    """The same with inductor's generated code (its first compile takes tens of seconds on CPU)."""
    config, stages = make(kind, recompute="selective")
    (eager,) = stages()
    (compiled,) = stages("inductor")
    want = split_steps(eager, config.vocab_size)
    got = split_steps(compiled, config.vocab_size)
    assert_close(got["grads"], want["grads"], atol=1e-10)
    assert got["closures"] == want["closures"] > 0 and got["early"] == want["early"]
    assert got["graphs"][1] == got["graphs"][2]


def test_compiled_fp8_stage_matches_eager():
    config, stages = make("deepseek", fp8=True)
    (eager,) = stages()
    (compiled,) = stages(BACKEND)
    want = split_steps(eager, config.vocab_size, steps=1)
    got = split_steps(compiled, config.vocab_size, steps=1)
    assert_equal(got["grads"], want["grads"])  # float32 through E4M3: no rounding tolerance would be safe
    assert got["closures"] == want["closures"] > 0


def test_compiled_fp8_stage_without_w_ops_shares_its_graphs_across_blocks():
    """A stage compiled, then converted to FP8 (the demo's ``--compile --fp8``), whose schedule gives it no W
    op (every backward fused: one rank, or ``schedules/fuse.py``), runs its FP8 layers outside the graphs as a
    splitting stage does: traced in,
    each layer's weight cache guarded the graph on that layer's own parameter, so every block compiled its
    own graph (the demo's ``--compile --fp8`` passed dynamo's recompile limit), and an optimizer step, which
    bumps the weights' versions, compiled them all again."""
    results = []
    for splits in (True, False):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = deepseek_config()
        (module,) = deepseek_stages(config, 1, source=DeepSeekV3Model(config), compile=BACKEND)
        convert_to_fp8(module)  # after compiling, as the demo does
        stage = Stage(module, 0, 0, True, True, WeightGradStore(), splits=splits)
        graphs = []
        for step in range(2):
            t = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
            stage.forward(0, (t[:, :-1],), module.criterion, (t[:, 1:],), True, False)
            stage.backward(0, None, split=splits)
            if splits:
                stage.weight(0)
            graphs.append(counters["stats"]["unique_graphs"])
            with torch.no_grad():  # an optimizer step: every weight's version moves
                for p in module.parameters():
                    p.sub_(1e-3 * p.grad)
        results.append((graphs, {n: p.grad for n, p in module.named_parameters()}))
    (split_graphs, split_grads), (fused_graphs, fused_grads) = results
    assert fused_graphs == split_graphs and fused_graphs[0] == fused_graphs[1] > 0
    assert_equal(fused_grads, split_grads)


def test_compile_option_is_checked():
    assert check_backend(True) == "inductor" and check_backend(False) is None
    with pytest.raises(ValueError, match=r"compile='tvm': give True, False or one of"):
        llama_stages(llama_config(), 1, compile="tvm")


# ----- 2 gloo ranks ------------------------------------------------------------------------------------------
def _pipeline_worker(rank: int, world: int, kind: str, schedule: str) -> dict:
    from mt_dualpipe import DualPipe, Pipeline
    from mt_dualpipe.models.deepseek_v3 import criterion_for, stages_for_rank, sync_replicas
    from mt_dualpipe.models.llama.stages import stages_for_rank as llama_for_rank
    from mt_dualpipe.schedules.registry import build_schedule
    from tests.helpers.fb_units import fb_unit_counter
    from tests.models.test_recompute import batch

    num_mb = 4
    sched = build_schedule(schedule, world, num_mb)
    out = {}
    for compile in (False, BACKEND):
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = deepseek_config() if kind == "deepseek" else llama_config(layers=4)
        if kind == "deepseek":
            mods = stages_for_rank(config, sched, rank, source=DeepSeekV3Model(config), compile=compile)
        else:
            mods = llama_for_rank(config, sched, rank, source=LlamaForCausalLM(config), compile=compile)
        data = [batch(config, 100 + m, rows=1) for m in range(num_mb)]
        pipe = DualPipe(tuple(mods), timeout=120) if schedule == "dualpipe" else Pipeline(mods, sched, timeout=120)
        pipe.fuse_backward = False  # the compiled stages' own split is what is compared
        first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
        last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
        inputs = [torch.cat([data[m][0] for m in sched.microbatches_of(first[0])])] if first else []
        labels = (torch.cat([data[m][1] for m in sched.microbatches_of(last[0])]),) if last else ()
        graphs = []
        with fb_unit_counter() as overlapped:
            for _ in range(2):
                for m in mods:
                    m.zero_grad(set_to_none=True)
                graphs.append(counters["stats"]["unique_graphs"])
                pipe.step(*inputs, num_chunks=num_mb, criterion=criterion_for(mods), labels=labels)
        graphs.append(counters["stats"]["unique_graphs"])
        sync_replicas(mods, dist.group.WORLD)
        grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
                 if p.grad is not None}
        out[str(compile)] = {"grads": grads, "closures": pipe.store.closures_run, "graphs": graphs,
                             "overlapped": len(overlapped)}
    return out


@pytest.mark.parametrize("kind,schedule", [("deepseek", "dualpipe"), ("llama", "zbv")])
def test_compiled_stages_in_a_pipeline_match_eager(kind, schedule):
    for res in run_ranks(_pipeline_worker, 2, kind, schedule, timeout=400):
        eager, compiled = res["False"], res[BACKEND]
        assert_equal(compiled["grads"], eager["grads"])
        assert compiled["closures"] == eager["closures"] > 0
        first, second, end = compiled["graphs"]
        assert second > first and end == second  # no recompilation at the second step
        if schedule == "dualpipe":  # DualPipe's F&B units ran the compiled blocks
            assert compiled["overlapped"] > 0


def test_benchmark_prints_both_families_side_by_side():
    """``benchmarks/compile_step.py`` (aot_eager, one short round): a row per family and side, the same W
    closures per step on both sides and no recompilation."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "benchmarks" / "compile_step.py"), "--steps", "1", "--rounds", "1",
           "--backend", "aot_eager", "--seq", "16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    model = None
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if len(cells) == 8 and cells[1] in ("eager", "compiled"):
            model = cells[0] or model
            rows[model, cells[1]] = cells
    assert set(rows) == {(m, s) for m in ("DeepSeek-V3", "Llama") for s in ("eager", "compiled")}
    for m in ("DeepSeek-V3", "Llama"):
        assert rows[m, "eager"][5] == rows[m, "compiled"][5] and int(rows[m, "eager"][5]) > 0  # W closures / step
        assert rows[m, "compiled"][7] == "0"  # recompilations after the first step
