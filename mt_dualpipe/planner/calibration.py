"""The planner against published training runs: each run asked at its published layout.

The runs live in ``mt_dualpipe/planner/data/published_runs.json``, package data (source, layout, the
published figure and how a step time follows from it, and whether the row informed a constant of the
model: ``tuned_on``; the others are held out). ``calibrate`` estimates each run with the unchanged
planner (``estimate``) and returns the predicted and published step times and their ratio;
``benchmarks/planner_calibration.py`` prints them and ``tests/planner/test_planner_calibration.py``
keeps every row within ``TOLERANCE``.

A run that publishes achieved TFLOPs per GPU rather than hours (Llama 3) gets its published step time
from the planner's own FLOP count: ``model FLOPs per step / (gpus x published TFLOP/s)``, so the ratio
is the published throughput over the predicted one, independent of how either side counts FLOPs.

A run whose published hours cover a batch-size ramp (DeepSeek-V3: 3,072 to 15,360 sequences over the
first 469B tokens) is predicted over the same ramp (``ramp_step``): the ramp's tokens at ``steps``
evenly spaced batch sizes, each at its own estimated step time, the rest at the full batch, the total
divided by the full-batch step count the published figure was divided by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .activations import memory_savers
from .estimate import Estimate, Strategy, estimate
from .megatron_layer import with_implementation
from .model import ModelSpec
from .system import SystemSpec, load_system

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"  # package data: installed with the wheel
"""The published runs (in the repository, next to the benchmark that prints them)."""
TOLERANCE = 0.15
"""How far a prediction may be from the published figure (issue 31: every row within 15 %)."""


@dataclass(frozen=True)
class Calibrated:
    """One published run, the planner's prediction at its layout, and the ratio predicted / published."""

    name: str
    source: str
    tuned_on: bool
    estimate: Estimate
    published_step_s: float
    published_memory_gb: float | None = None

    predicted_s: float | None = None  # the prediction when it is not the estimate's own (a batch ramp)

    @property
    def predicted_step_s(self) -> float:
        return self.predicted_s if self.predicted_s is not None else self.estimate.step_time

    @property
    def ratio(self) -> float:
        return self.predicted_step_s / self.published_step_s

    @property
    def memory_ratio(self) -> float | None:
        if self.published_memory_gb is None:
            return None
        return self.estimate.total_memory_gb / self.published_memory_gb

    @property
    def within(self) -> bool:
        """Within ``TOLERANCE`` on step time, and on memory where the source publishes it."""
        ok = abs(self.ratio - 1) <= TOLERANCE
        mem = self.memory_ratio
        return ok and (mem is None or abs(mem - 1) <= TOLERANCE)


def load_runs(path: Path = DATA) -> dict:
    """The published-runs document (``models`` and ``runs``)."""
    return json.loads(path.read_text())


def run_model(name: str, models: dict) -> ModelSpec:
    """A run's model: one described in the data file, else a bundled one (``ModelSpec.load``). A described
    model may name the ``implementation`` whose layers the run built (``megatron_layer.IMPLEMENTATIONS``):
    what a layer keeps and moves is that implementation's, not this library's modules'."""
    if name in models:
        data = {k: v for k, v in models[name].items() if not k.startswith("_")}
        implementation = data.pop("implementation", "mt_dualpipe")
        return with_implementation(ModelSpec.from_dict(data, source=name), implementation)
    return ModelSpec.load(name)


def run_strategy(run: dict) -> Strategy:
    """The run's published layout as a planner strategy (micro-batches from the global batch; its stage cut
    and core attention where the run gives them)."""
    s = dict(run["strategy"])
    per_replica = s["dp"]  # the planner's dp counts the expert-parallel ranks too (Megatron's way)
    mbs = s.get("micro_batch_size", 1)
    if run["global_batch"] % (per_replica * mbs):
        raise ValueError(f"{run['name']}: global batch {run['global_batch']} is not a multiple of dp x mbs")
    return Strategy(pp=s["pp"], schedule=s["schedule"], num_microbatches=run["global_batch"] // (per_replica * mbs),
                    ep=s.get("ep", 1), dp=s["dp"], micro_batch_size=mbs, seq_len=s["seq_len"],
                    zero=s.get("zero", 1), dtype=s.get("dtype", "bf16"), recompute=s.get("recompute", "selective"),
                    virtual_stages=s.get("virtual_stages", 1), tp=s.get("tp", 1),
                    layers_per_stage=tuple(s["layers_per_stage"]) if "layers_per_stage" in s else None,
                    attention=s.get("attention", "fused"))


def published_step(run: dict, model: ModelSpec, strategy: Strategy) -> float:
    """The run's published step time: given, or from its published TFLOPs per GPU (module doc)."""
    if "published_step_s" in run:
        return float(run["published_step_s"])
    flops = model.flops_per_token(strategy.seq_len) * strategy.seq_len * run["global_batch"]
    return flops / (run["gpus"] * run["published_tflops_per_gpu"] * 1e12)


def calibrate(path: Path = DATA) -> list[Calibrated]:
    """Every published run estimated at its layout (the planner unchanged, the GPU count checked)."""
    doc = load_runs(path)
    out = []
    for run in doc["runs"]:
        model = run_model(run["model"], doc.get("models", {}))
        strategy = run_strategy(run)
        if strategy.gpus != run["gpus"]:
            raise ValueError(f"{run['name']}: layout covers {strategy.gpus} GPUs, the run used {run['gpus']}")
        system = load_system(run["system"])
        with memory_savers(run.get("memory_savers", "none")):  # what the run's modules kept (DeepSeek-V3's)
            est = estimate(model, system, strategy)
            predicted = ramp_step(run, model, system, strategy, est) if run.get("batch_ramp") else None
        out.append(Calibrated(run["name"], run["source"], bool(run.get("tuned_on")), est,
                              published_step(run, model, strategy), run.get("published_memory_gb"), predicted))
    return out


def ramp_step(run: dict, model: ModelSpec, system: SystemSpec, strategy: Strategy, full: Estimate) -> float:
    """The full-batch-equivalent step time of a run with a batch-size ramp (module doc): total predicted
    seconds for ``run["tokens"]`` over the number of full-batch steps those tokens make."""
    ramp = run["batch_ramp"]
    seq, batch = strategy.seq_len, run["global_batch"]
    per_batch = strategy.dp * strategy.micro_batch_size  # sequences one micro-batch round takes
    n = int(ramp["steps"])
    share = float(ramp["tokens"]) / n
    total = 0.0
    for i in range(n):
        b = ramp["start"] + (batch - ramp["start"]) * i / n
        # whole, even micro-batch counts, at least the 2 x pp DualPipe needs (the schedule's smallest batch)
        m = max(2 * strategy.pp, 2 * round(b / (2 * per_batch)))
        b = m * per_batch
        est = estimate(model, system, replace(strategy, num_microbatches=m))
        total += share / (b * seq) * est.step_time
    total += (float(run["tokens"]) - float(ramp["tokens"])) / (batch * seq) * full.step_time
    return total / (float(run["tokens"]) / (batch * seq))
