"""Planner output: a rich table of the best configurations and the JSON document."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .activations import active_savers
from .estimate import Estimate
from .families import PlannedFamily, family_of
from .model import ModelSpec
from .runnable import short_reason
from .search import PlanResult


def model_title(model: ModelSpec) -> str:
    """The model as a title names it: its name, the file it came from and its parameter count, so a
    reader sees at once whether the description was read as meant."""
    where = f"{model.source}, " if model.source else ""
    return f"{model.name} ({where}{model.total_params() / 1e9:.2f} B parameters)"


def plan_table(result: PlanResult, top: int = 10):
    """A ``rich.table.Table`` of the ``top`` fastest configurations that fit."""
    system = result.system
    cap = system.gpu_memory_gb * system.mem_factor
    table = Table(title=f"{model_title(result.model)} on {result.gpus} x {system.name} "
                        f"({system.gpu_memory_gb:g} GB, usable {cap:.1f} GB), global batch {result.global_batch}")
    for col in COLUMNS:
        table.add_column(col, justify="right" if col not in ("schedule", "run") else "left")
    ref = result.reference
    for i, e in enumerate(result.ranked[:top]):
        s, m = e.strategy, e.memory_gb
        name = s.schedule_label
        style = "bold green" if ref is not None and e is ref else None
        table.add_row(str(i + 1), str(s.pp), name, str(s.num_microbatches), str(s.ep), str(s.dp), str(s.tp),
                      f"{e.step_time:.2f}", f"{e.pipeline_time:.2f}", f"{e.dp_sync_time:.2f}",
                      f"{e.dp_sync_total:.2f}", f"{e.bubble_rate:.1%}",
                      f"{e.mfu:.1%}", f"{m['weights']:.1f}", f"{m['gradients']:.1f}", f"{m['optimizer']:.1f}",
                      f"{m['activations']:.1f}", f"{m['total']:.1f}", short_reason(e.unrunnable), style=style)
    return table


COLUMNS = ("#", "pp", "schedule", "M", "ep", "dp", "tp", "step s", "pipe s", "sync s", "of s", "bubble",
           "MFU", "weights", "grads", "optim", "activ", "mem GB", "run")
"""The plan table's columns; "sync s" is the data-parallel sync the pipeline does not hide (exposed),
"of s" the same sync with nothing hidden; "run" whether the runtime can launch the row."""


def recompute_line(recompute: str, family: PlannedFamily) -> str:
    """What the recompute policy keeps, in the planned family's terms (``models/recompute.py`` applies it)."""
    if recompute == "selective":
        return f"selective recompute ({family.selective})"
    if recompute == "full":
        return "full recompute (each layer keeps its input; a MoE layer's routing, dispatch and combine still keep " \
               "theirs)"
    return "no recompute"


def savers_line(strategy, family: PlannedFamily, savers: frozenset[str] | None = None) -> str:
    """The memory savers an estimate models (all implemented by the runtime) and those it leaves out, in the
    planned ``family``'s terms (its own activation savers, ``planner/families.py``); ``savers``: the
    activation savers the estimate counted (default: those active now)."""
    parts = [recompute_line(strategy.recompute, family)]
    if strategy.dtype == "fp8":
        parts.append("FP8-cached inputs of the FP8 linears (FP8Linear: E4M3 + 1x128 scales, the experts' inputs "
                     "after dispatch included; one copy per linear, one per SwiGLU), FP8 dispatch, the FP8 weight "
                     "copies in 'weights', BF16 Adam moments")
    on = [s for s in family.savers if s in (active_savers() if savers is None else savers)]
    off = "off (--memory-savers all turns them on: " + ", ".join(family.savers) + ")"
    parts.append(f"{family.owner} activation savers " + (", ".join(sorted(on)) if on else off))
    return "memory savers modelled (all in the runtime): " + "; ".join(parts) + "."


def notes(result: PlanResult, top: int = 10) -> list[str]:
    """The lines under the table: what the sync columns mean, and why rows cannot be launched."""
    out = ["sync s: data-parallel gradient sync left exposed after each stage's reduction overlaps the pipeline's "
           "drain (simulated, plus ZeRO-1's parameter all-gather after the step); of s: the same sync unhidden. "
           "dp counts expert-parallel ranks (Megatron's convention); JSON \"launch\" gives the runtime's mesh dp."]
    reasons = sorted({r for e in result.ranked[:top] for r in e.unrunnable})
    if reasons:
        out.append("run no: the runtime cannot launch it yet — " + "; ".join(reasons)
                   + ". --runnable-only ranks only the configurations it can.")
    return out


def memory_lines(est: Estimate) -> list[str]:
    """An estimate's memory per GPU on its fullest rank, term by term (``memory_terms``: the formula and
    the code that keeps each), with every rank's total."""
    s = est.strategy
    ranks = " ".join(f"{gb:.1f}" for gb in est.per_rank_gb)
    out = [f"memory per GPU of {s.describe()} {s.dtype} recompute {s.recompute}, zero {s.zero}: rank "
           f"{est.memory_rank} of {s.pp} is the fullest (blocks per stage {est.blocks_per_stage}; every rank's "
           f"total in GB: {ranks})"]
    out += ["  " + t.line() for t in est.memory_terms]
    out.append(f"  {'total':<11} {est.total_memory_gb:6.2f} GB")
    if est.rank_memory and est.memory_rank != 0:  # rank 0 holds the embedding (and, V or dual, the head and MTP)
        m = est.rank_memory[0]
        out.append(f"rank 0 (the embedding's): weights {m['weights']:.2f} + gradients {m['gradients']:.2f} + optimizer "
                   f"{m['optimizer']:.2f} + activations {m['activations']:.2f} = {m['total']:.2f} GB")
    return out


def print_plan(result: PlanResult, top: int = 10, console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if console.width < 170:  # the table has 19 columns: do not squeeze it into a pipe's 80
            console = Console(width=170)
    if not result.ranked:
        console.print(f"{model_title(result.model)}: no configuration fits in {result.system.gpu_memory_gb:g} GB "
                      f"({len(result.rejected)} estimated, {result.skipped} combinations ruled out"
                      + (f", {result.not_runnable} not runnable left out (JSON 'unrunnable' says why)"
                         if result.not_runnable else "") + ")")
        if result.rejected:
            e = min(result.rejected, key=lambda r: r.total_memory_gb)
            s, m = e.strategy, e.memory_gb
            console.print(f"smallest: pp{s.pp} {s.schedule_label} M={s.num_microbatches} ep{s.ep} dp{s.dp} "
                          f"mbs{s.micro_batch_size} {s.dtype} recompute {s.recompute}: weights {m['weights']:.1f} + "
                          f"grads {m['gradients']:.1f} + optimizer {m['optimizer']:.1f} + activations "
                          f"{m['activations']:.1f} = {m['total']:.1f} GB per GPU")
            console.print(savers_line(s, family_of(result.model), result.memory_savers), soft_wrap=True)
    else:
        console.print(plan_table(result, top))
        console.print(f"{len(result.ranked)} configurations fit, {len(result.rejected)} exceed the memory, "
                      f"{result.skipped} combinations ruled out (divisibility or schedule rules)"
                      + (f", {result.not_runnable} left out as not runnable" if result.not_runnable else ""))
        for line in notes(result, top):
            console.print(line)
        shown = result.reference or result.ranked[0]
        for line in memory_lines(shown):
            console.print(line, highlight=False, markup=False)
        console.print(savers_line(shown.strategy, family_of(result.model), result.memory_savers), soft_wrap=True)
    if result.verdict:
        console.print(result.verdict)


def write_json(result: PlanResult, path: str, top: int = 20) -> None:
    with open(path, "w") as fh:
        json.dump(result.to_dict(top), fh, indent=2)
        fh.write("\n")
