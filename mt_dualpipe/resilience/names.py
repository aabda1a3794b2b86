"""Global names for a rank's training state: what makes a checkpoint loadable at another layout.

A snapshot is per rank. For a checkpoint to load at another data-parallel size, each tensor must
be saved under a name every rank agrees on, and sharded state must be a ``DTensor`` so DCP stores
it by global offsets (``parallel/checkpoint.py``). Names follow the pipeline's convention
(``Pipeline.build_optimizer``): a stage module's entry ``fqn`` is ``stage<s>.<fqn>``, where ``s`` is
the stage index — the same on every rank holding a copy (DualPipe's mirrored stages, the dp
replicas), so DCP writes one copy of replicated values and every chunk of sharded ones.

The optimizer's state is named by parameter: a ``torch.optim`` optimizer by its parameters'
positions, a ``parallel.ZeroOptimizer`` by its parameters, a ``PipelineOptimizer`` (or anything
whose ``state_dict()`` already uses the pipeline's names) as is. State that cannot be named this
way stays per rank: such a checkpoint resumes only on the same number of ranks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.zero import ZeroOptimizer
from ..runtime.modules import Pipeline


def stage_prefixes(pipeline: Any, modules: Sequence[nn.Module]) -> list[str] | None:
    """``stage<s>.`` for each local module, from the pipeline's placement; None when unknown.

    A single process (``LocalPipeline``) holds every stage: module ``i`` is stage ``i``. A
    multi-process pipeline without a placement gets None (its modules cannot be named globally).
    """
    if isinstance(pipeline, Pipeline):
        local = [s for chain in pipeline.placement for s, r in enumerate(chain) if r == pipeline.rank]
        if len(local) == len(modules):
            return [f"stage{s}." for s in local]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [f"stage{i}." for i in range(len(modules))]
    return None


def _optimizer_keys(optimizer: Any, state: dict[str, Any], by_id: dict[int, str]) -> dict[Hashable, str] | None:
    """State key -> global parameter name, or None when some key has no name."""
    keys = list(state.get("state", {}))
    out: dict[Hashable, str | None]
    if isinstance(optimizer, ZeroOptimizer):
        out = {n: by_id.get(id(p)) for n, p in zip(optimizer.names, optimizer.params)}
    elif isinstance(optimizer, torch.optim.Optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        out = {i: by_id.get(id(p)) for i, p in enumerate(params)}
    else:  # already named the pipeline's way (PipelineOptimizer: stage<s>.<fqn>, tied.<fqn>)
        out = _PipelineNames()
    if any(out.get(k) is None for k in keys):
        return None
    return out  # type: ignore[return-value]  # every key the state uses has a name (checked above)


class _PipelineNames(dict):
    """The identity on names that already follow the pipeline's convention (state created later included)."""

    def __missing__(self, key: Hashable) -> str:
        if isinstance(key, str) and (key.startswith("stage") or key.startswith("tied.")):
            return key
        raise KeyError(key)

    def get(self, key: Hashable, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


@dataclass
class StateNames:
    """The global names of one rank's modules and optimizer state (see the module docstring)."""

    prefixes: list[str]                               # per local module
    optimizer: dict[Hashable, str] | None             # optimizer state key -> parameter name; None: per rank

    @classmethod
    def of(cls, pipeline: Any, modules: Sequence[nn.Module], optimizer: Any) -> StateNames | None:
        prefixes = stage_prefixes(pipeline, modules)
        if prefixes is None:
            return None
        by_id = {id(p): pre + n for pre, m in zip(prefixes, modules) for n, p in m.named_parameters()}
        keys = None
        if optimizer is not None and hasattr(optimizer, "state_dict"):  # any optimizer-like object
            keys = _optimizer_keys(optimizer, optimizer.state_dict(), by_id)
        return cls(prefixes, keys)

    def model_entries(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``model.stage<s>.<fqn>`` -> tensor for the modules' state dicts ``states``."""
        return {f"model.{pre}{k}": v for pre, sd in zip(self.prefixes, states) for k, v in sd.items()
                if isinstance(v, torch.Tensor)}

    def optimizer_entries(self, state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
        """``optim.<param name>.<state key>`` -> tensor for an optimizer state dict (empty: unnamed)."""
        if state is None or self.optimizer is None:
            return {}
        return {f"optim.{self.optimizer[k]}.{kk}": v for k, per in state["state"].items()
                for kk, v in per.items() if isinstance(v, torch.Tensor)}
