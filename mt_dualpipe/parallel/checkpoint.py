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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .zero import ZeroOptimizer


def _mesh(zopt: ZeroOptimizer) -> DeviceMesh:
    group = zopt.sync.group if zopt.sync.group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, zopt.sync.device.type)


def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the lazily-built state of ``optimizer`` with a zero-gradient, zero-lr step (params unchanged).

    The step counters are set back to 0 afterwards: the moments of a zero gradient are zero, so the
    state equals a fresh one and asking for a state dict before the first step (a snapshot, a
    checkpoint) does not change Adam's bias correction of the steps that follow.
    """
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, g in zip(params, grads):
        p.grad = g
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for st in optimizer.state.values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"].zero_()
        elif "step" in st:
            st["step"] = 0


def zero_state_dict(zopt: ZeroOptimizer) -> dict[str, Any]:
    """FQN-named optimizer state of ``zopt`` with ``Shard(0)`` DTensors (creates the state if missing)."""
    bad = [n for n, p in zip(zopt.names, zopt.params) if p.dim() == 0]
    if bad:
        raise ValueError(f"0-d parameters cannot be saved as Shard(0) DTensors: {bad}")
    init_optimizer_state(zopt.optimizer, zopt.shards)
    mesh = _mesh(zopt)
    state: dict[str, dict[str, Any]] = {}
    for name, p, shard in zip(zopt.names, zopt.params, zopt.shards):
        entry = {}
        for key, value in zopt.optimizer.state[shard].items():
            if isinstance(value, torch.Tensor) and value.shape == shard.shape and value.dim() > 0:
                value = DTensor.from_local(value, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            entry[key] = value
        state[name] = entry
    index = {id(t): n for n, t in zip(zopt.names, zopt.shards)}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(t)] for t in g["params"]]}
              for g in zopt.optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_zero_state_dict(zopt: ZeroOptimizer, sd: dict[str, Any]) -> None:
    """Copy an FQN-named state dict (DTensor or plain full/sharded values) into ``zopt``'s shards' state."""
    init_optimizer_state(zopt.optimizer, zopt.shards)
    rank = zopt.sync.rank
    for i, (name, shard) in enumerate(zip(zopt.names, zopt.shards)):
        if name not in sd["state"]:
            raise KeyError(f"optimizer state for parameter {name!r} is missing from the checkpoint")
        target = zopt.optimizer.state[shard]
        slot = zopt.sync.layout.slot_of[i][1]
        for key, value in sd["state"][name].items():
            if isinstance(value, DTensor):
                value = value.to_local()
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shard.shape:
                start = rank * slot.chunk_rows  # a full tensor: take this rank's rows
                value = value.reshape(slot.rows, slot.row_numel)[start: start + shard.shape[0]].view_as(shard)
            if isinstance(target.get(key), torch.Tensor):
                target[key].copy_(value)
            else:
                target[key] = value
    for group, saved in zip(zopt.optimizer.param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


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
