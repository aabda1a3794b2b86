"""ZeRO-1 optimizer state as DCP-ready state dicts: FQN-named, ``Shard(0)`` DTensors over the ZeRO group.

``ZeroOptimizer.state_dict()`` / ``load_state_dict()`` are these two functions; ``checkpoint.py``
builds DCP saves and loads on them. The structure is that of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for a plain optimizer —
``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` — with every
per-parameter state tensor a ``Shard(0)`` DTensor whose local part is this rank's chunk
(``layout.py``), so DCP stores it by global offsets and reshards it to another data-parallel size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
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
