"""When nothing fits, the plan prints the smallest configuration's memory breakdown and which memory
savers the estimate models (those the runtime implements) and which it leaves out."""

from __future__ import annotations

import io

from rich.console import Console

from mt_dualpipe.planner import ModelSpec
from mt_dualpipe.planner.activations import SAVERS
from mt_dualpipe.planner.report import print_plan
from mt_dualpipe.planner.search import plan
from mt_dualpipe.planner.system import load_system


def test_nothing_fits_prints_the_smallest_breakdown_and_the_savers():
    model = ModelSpec.load("deepseek-v3")
    system = load_system("h800").replace(gpu_memory_gb=80.0)
    result = plan(model, system, 2048, pp=[16], ep=[64], schedules=("dualpipe",), dtype="fp8", recompute="selective")
    assert not result.ranked and len(result.rejected) == 1
    out = io.StringIO()
    print_plan(result, console=Console(file=out, width=400))
    text = out.getvalue()
    m = result.rejected[0].memory_gb
    assert (f"smallest: pp16 dualpipe M=120 ep64 dp128 mbs1 fp8 recompute selective: weights {m['weights']:.1f} + "
            f"grads {m['gradients']:.1f} + optimizer {m['optimizer']:.1f} + activations {m['activations']:.1f} = "
            f"{m['total']:.1f} GB per GPU") in text
    assert "memory savers modelled (all in the runtime): selective recompute" in text
    assert "FP8-cached inputs of the FP8 linears" in text
    assert "DeepSeek-V3's activation savers off (--memory-savers all turns them on: " + ", ".join(SAVERS) in text
    # the FP8 weight copies (1 byte per converted parameter) are part of the weights: more than BF16's 2 bytes
    bf16 = plan(model, system, 2048, pp=[16], ep=[64], schedules=("dualpipe",), dtype="bf16", recompute="selective")
    assert m["weights"] > bf16.rejected[0].memory_gb["weights"] * 1.4
