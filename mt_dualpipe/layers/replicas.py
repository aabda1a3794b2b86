"""Summing the copies of one parameter: mirrored stages, tied embeddings, data-parallel replicas.

For loops that run stage modules without a ``Pipeline``; a ``Pipeline`` sums what its stages declare in
``tied_parameters`` (and, with a mesh, the data-parallel replicas) inside its step, so calling this after
a step would count those copies twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.device import collective_device


def parameter_grads(modules: Sequence[nn.Module]) -> dict[str, list[torch.Tensor]]:
    """Every trainable parameter's gradient by name (a missing one becomes zeros, so it can be summed into)."""
    out: dict[str, list[torch.Tensor]] = {}
    seen: set[int] = set()  # a parameter that two stages share is one copy
    for m in modules:
        for name, p in m.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.setdefault(name, []).append(p.grad)
    return out


@torch.no_grad()
def sum_copies(local: dict[str, list[torch.Tensor]], group: dist.ProcessGroup | None = None) -> None:
    """Make every tensor of a name the sum of all of that name's tensors, on this rank and across ``group``.

    Only names that more than one rank holds take part in the collective (which names each rank holds
    is exchanged first), so ranks may hold different stages. Every rank of ``group`` must call it.
    """
    for copies in local.values():  # copies on this rank first (a V schedule's first and last stage)
        if len(copies) > 1:
            total = copies[0].clone()
            for t in copies[1:]:
                total += t
            for t in copies:
                t.copy_(total)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, {n: ts[0].numel() for n, ts in local.items()}, group=group)
    holders: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for got in gathered:
        for n, k in got.items():
            holders[n] = holders.get(n, 0) + 1
            sizes[n] = k
    shared = sorted(n for n, c in holders.items() if c > 1)
    if not shared:
        return
    dtype = next(iter(local.values()))[0].dtype if local else torch.float32
    flat = torch.zeros(sum(sizes[n] for n in shared), dtype=dtype, device=collective_device(group))
    offsets, pos = {}, 0
    for n in shared:
        offsets[n] = pos
        pos += sizes[n]
        if n in local:
            flat[offsets[n]:pos] = local[n][0].flatten()
    dist.all_reduce(flat, group=group)
    for n in shared:
        for t in local.get(n, []):
            t.copy_(flat[offsets[n]:offsets[n] + sizes[n]].view_as(t))


def sync_replicas(modules: Sequence[nn.Module], group: dist.ProcessGroup | None = None,
                  tensors: Callable[[Sequence[nn.Module]], dict[str, list[torch.Tensor]]] = parameter_grads) -> None:
    """Sum the gradients (or what ``tensors`` selects) over every copy of the same name: this rank's
    stages and, with ``group``, the other ranks' (module doc). Every rank of ``group`` must call it."""
    sum_copies(tensors(list(modules)), group)
