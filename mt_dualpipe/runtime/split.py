"""``split_model``: cut a stack of layers into a schedule's stages and hand a rank its own.

A user with an ``nn.Sequential`` (or a list of layers) should not have to build a throwaway
schedule to learn which stages a rank holds. The stages are contiguous runs of layers, balanced so
that the most expensive stage is as cheap as possible (the pipeline runs at the pace of its slowest
stage); a layer's cost is its parameter count unless ``costs`` are given (e.g. measured times).
Every chain of a placement runs the same stages, so a dual placement's second chain gets the same
cut (its modules are the mirrored copies a ``DualPipe`` keeps in sync).

A stage is a ``SplitStage``: its layers run in order, a layer's tuple output unpacked into the next layer's
arguments, so stages take and return several tensors (ids with an attention mask or position ids, hidden
states with vision features) as hand-made stages do. A parameter that layers on different stages share (a tied
embedding and head, found by identity over the whole model, before the cut) is declared in each holder's
``tied_parameters`` under one key, so every ``Pipeline`` sums its copies' gradients whatever ranks they land
on; undeclared, the copies would train apart and every gradient of them would be wrong.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ..schedules.errors import ScheduleError
from ..schedules.ir import Schedule
from ..schedules.placements import balanced_cuts
from ..schedules.registry import schedule_info
from .errors import PipelineError


def _placement(schedule: str | Schedule, num_ranks: int, options: dict) -> tuple[tuple[int, ...], ...]:
    if isinstance(schedule, Schedule):
        return tuple(tuple(c) for c in schedule.placement)
    try:
        return schedule_info(schedule).layout(num_ranks, **options).ranks
    except ScheduleError as exc:
        raise PipelineError(str(exc)) from None


_KEYWORD_INPUTS = ("position_embeddings", "attention_mask", "position_ids")
ADAPTER_HINT = ("build the stages from the whole model instead: mt_dualpipe.stages_for_rank(model, schedule, rank) "
                "with model = mt_dualpipe.from_pretrained(path) or the transformers model itself, and "
                "mt_dualpipe.criterion_for(stages) as the criterion (docs/models.md, section \"Any transformers "
                "decoder-only model\")")


def _from_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _check_layers(layers: object) -> list[nn.Module]:
    """``layers`` as a list; a clear error for what a stack of layers called one after another cannot run: a whole
    model, or transformers decoder layers (their body hands each one rotary embeddings and a mask)."""
    if isinstance(layers, nn.Module) and not hasattr(layers, "__iter__"):
        hint = f"; {ADAPTER_HINT}" if _from_transformers(layers) else ""
        raise PipelineError(f"split_model takes a stack of layers (nn.Sequential, nn.ModuleList or a list), got a "
                            f"{type(layers).__name__}{hint}")
    out = list(layers)  # type: ignore[call-overload]
    for layer in out:
        if not _from_transformers(layer):
            continue
        wanted = [p for p in inspect.signature(layer.forward).parameters if p in _KEYWORD_INPUTS]
        if wanted:
            raise PipelineError(f"split_model got transformers' {type(layer).__name__}, whose forward takes "
                                f"{', '.join(wanted)} from the model's body, which a stage of layers called one "
                                f"after another does not pass; {ADAPTER_HINT}")
    return out


class SplitStage(nn.Sequential):
    """Layers run in order; a tuple output is unpacked into the next layer's arguments (the stage's own
    arguments into the first layer's), so a stage passes several tensors on. ``tied_parameters``: the
    weights it shares with other stages ({FQN: key}, ``split_model`` fills it)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.tied_parameters: dict[str, str] = {}

    def forward(self, *inputs: Any) -> Any:
        out: Any = inputs
        for layer in self:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


def shared_parameters(layers: Sequence[nn.Module]) -> dict[int, str]:
    """id(parameter) -> tie key, for every parameter that two or more ``layers`` hold (by identity)."""
    holders: dict[int, set[int]] = {}
    order: list[int] = []
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if id(p) not in holders:
                holders[id(p)] = set()
                order.append(id(p))
            holders[id(p)].add(i)
    shared = [pid for pid in order if len(holders[pid]) > 1]
    return {pid: f"shared.{k}" for k, pid in enumerate(shared)}


def split_model(layers: nn.Sequential | Sequence[nn.Module], schedule: str | Schedule, rank: int,
                num_ranks: int | None = None, *, costs: Sequence[float] | None = None,
                schedule_options: dict | None = None) -> list[nn.Module]:
    """The stage modules of ``rank`` for ``schedule``, in the order ``Pipeline`` takes them.

    ``layers`` is cut into the schedule's stages (contiguous, balanced by parameter count or by
    ``costs``, one number per layer); each stage is a ``SplitStage`` of its layers (the layer objects
    themselves, not copies), declaring the weights it shares with other stages. ``num_ranks`` defaults to
    the world size of the initialised default process group. Pass the result to
    ``Pipeline(split_model(...), schedule)``.
    """
    layers = _check_layers(layers)
    if num_ranks is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PipelineError("split_model needs num_ranks= when torch.distributed is not initialized")
        num_ranks = dist.get_world_size()
    placement = _placement(schedule, num_ranks, dict(schedule_options or {}))
    num_stages = len(placement[0])
    if not 0 <= rank < num_ranks:
        raise PipelineError(f"rank must be in 0..{num_ranks - 1}, got {rank}")
    if len(layers) < num_stages:
        raise PipelineError(f"the model has {len(layers)} layer(s) but the schedule on {num_ranks} ranks has "
                            f"{num_stages} stages per chain; give at least one layer per stage")
    if costs is None:
        costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    elif len(costs) != len(layers) or any(c < 0 for c in costs):
        raise PipelineError(f"costs must be {len(layers)} non-negative numbers, one per layer; got {list(costs)}")
    bounds = balanced_cuts(list(costs), num_stages)
    shared = shared_parameters(layers)
    stage_of = {i: s for s in range(num_stages) for i in range(bounds[s], bounds[s + 1])}
    across = {key for pid, key in shared.items()
              if len({stage_of[i] for i, layer in enumerate(layers)
                      for p in layer.parameters() if id(p) == pid}) > 1}
    out = []
    for s in (s for chain in placement for s, r in enumerate(chain) if r == rank):
        stage = SplitStage(*layers[bounds[s]: bounds[s + 1]])
        stage.tied_parameters = {fqn: shared[id(p)] for fqn, p in stage.named_parameters()
                                 if id(p) in shared and shared[id(p)] in across}
        out.append(stage)
    return out
