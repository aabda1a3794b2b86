"""Checkpoints of ZeRO-1-sharded training state with DCP, loadable at another data-parallel size.

``ZeroOptimizer.state_dict()`` uses the same structure as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for a plain optimizer —
``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` — with every
per-parameter state tensor a ``Shard(0)`` DTensor over the ZeRO group (its local part is this
rank's chunk, see ``layout.py``) and scalars (``step``) as plain tensors. DCP stores each DTensor
by global offsets, so a checkpoint written at dp=2 loads at dp=1, into a ZeroOptimizer over a
different group size, or into a plain ``torch.optim`` optimizer — and the reverse: DCP reads
each rank's slice of the saved full tensors. ``save_training_state`` / ``load_training_state``
do that for one stage module plus its optimizer; parameters are plain (replicated) tensors.
FQNs must be unique across the ranks that save together: pass ``prefix`` (e.g. ``"stage3."``)
when several pipeline stages share one checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from .zero import ZeroOptimizer
from .zero_state import init_optimizer_state, load_zero_state_dict, zero_state_dict

__all__ = ["init_optimizer_state", "load_training_state", "load_zero_state_dict", "save_training_state",
           "zero_state_dict"]


def _optim_state(module: nn.Module, optimizer: ZeroOptimizer | torch.optim.Optimizer) -> dict[str, Any]:
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.state_dict()
    init_optimizer_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
    return get_optimizer_state_dict(module, optimizer)


def _prefixed(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    if not prefix:
        return sd
    return {"state": {prefix + k: v for k, v in sd["state"].items()},
            "param_groups": [{**g, "params": [prefix + n for n in g["params"]]} for g in sd["param_groups"]]}


def _unprefixed(sd: dict[str, Any], prefix: str) -> dict[str, Any]:
    if not prefix:
        return sd
    n = len(prefix)
    return {"state": {k[n:]: v for k, v in sd["state"].items()},
            "param_groups": [{**g, "params": [p[n:] for p in g["params"]]} for g in sd["param_groups"]]}


def save_training_state(path: str | os.PathLike, module: nn.Module, optimizer: ZeroOptimizer | torch.optim.Optimizer,
                        *, prefix: str = "", process_group: dist.ProcessGroup | None = None) -> None:
    """DCP-save ``module``'s parameters and ``optimizer``'s (sharded or plain) state to ``path``."""
    model = {prefix + k: v for k, v in module.state_dict().items()}
    dcp.save({"model": model, "optim": _prefixed(_optim_state(module, optimizer), prefix)},
             checkpoint_id=path, process_group=process_group)


def load_training_state(path: str | os.PathLike, module: nn.Module, optimizer: ZeroOptimizer | torch.optim.Optimizer,
                        *, prefix: str = "", process_group: dist.ProcessGroup | None = None) -> None:
    """DCP-load what ``save_training_state`` wrote, at any data-parallel size, into ``module`` and ``optimizer``."""
    model = {prefix + k: v for k, v in module.state_dict().items()}
    optim = _prefixed(_optim_state(module, optimizer), prefix)
    sd = {"model": model, "optim": optim}
    dcp.load(sd, checkpoint_id=path, process_group=process_group)
    module.load_state_dict({k[len(prefix):]: v for k, v in sd["model"].items()})
    optim = _unprefixed(sd["optim"], prefix)
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_state_dict(optim)
        optimizer.refresh_shards()
    else:
        set_optimizer_state_dict(module, optimizer, optim)
