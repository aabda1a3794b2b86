"""How ``Pipeline.step`` cuts the caller's inputs (or labels) into micro-batches.

Each value is one of three things, the same for every value of a step:

* a batched ``Tensor``, split into equal micro-batches along ``batch_dim`` (``torch.tensor_split``);
* a list (or tuple) with one ``Tensor`` per micro-batch, whose shapes may differ between
  micro-batches (a *ragged* step: sequences of different lengths, a token budget per
  micro-batch). Nothing is padded or copied: micro-batch m is the list's m-th tensor;
* ``None``, which stays None in every micro-batch.

The runtime copes with shapes that differ per micro-batch by itself (messages are keyed per
micro-batch and their shapes relearned when a step's input shapes change, ``comm.py``); only this
splitting had to know. With data parallelism over the global batch (``dp_batch="global"``) every
replica takes its contiguous share of rows of every micro-batch (``replica_share``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .data_parallel import replica_slice
from .errors import PipelineError


class MicrobatchError(PipelineError):
    """The values cannot be cut into micro-batches; ``kind`` says why, for the step-start agreement's code:
    "type" (neither tensors, lists nor None), "mixed" (lists beside batched tensors), "count" (a list of
    another length than the micro-batches asked for) or "split" (a batch that does not split)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def is_ragged(values: Sequence[Any]) -> bool:
    """Whether any value is a list (or tuple) of micro-batches."""
    return any(isinstance(v, (list, tuple)) for v in values)


def split(values: Sequence[Any], n: int, dim: int, what: str, allow_uneven: bool = False,
          count_hint: str = "") -> list[tuple]:
    """``n`` micro-batches (tuples with one entry per value) from batched tensors or lists of micro-batches.

    ``count_hint`` says where ``n`` comes from when it is not the step's ``num_chunks`` (a chain
    running only some of them); a list of another length is refused with it.
    """
    kinds = {type(v).__name__ for v in values if v is not None and not isinstance(v, (torch.Tensor, list, tuple))}
    if kinds:
        raise MicrobatchError("type", f"{what} must be Tensors, lists of Tensors (one per micro-batch) or None, got "
                              f"{', '.join(sorted(kinds))}")
    if not is_ragged(values):
        return _split_batched(values, n, dim, what, allow_uneven)
    batched = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if batched:
        first = batched[0]
        raise MicrobatchError("mixed", f"{what} mix lists of micro-batches with batched tensors ({what} {first} is a "
                              f"Tensor of shape {tuple(values[first].shape)}); pass every value as a list with one "
                              "tensor per micro-batch, or every value as one batched tensor")
    return _split_ragged(values, n, what, count_hint)


def _split_ragged(values: Sequence[Any], n: int, what: str, count_hint: str) -> list[tuple]:
    """Micro-batch m: the m-th tensor of every list (None stays None)."""
    for i, v in enumerate(values):
        if v is None:
            continue
        if len(v) != n:
            wanted = count_hint or f"num_chunks={n}"
            raise MicrobatchError("count", f"{what} {i} is a list of {len(v)} micro-batches but {wanted}; pass a "
                                  f"list of {n} tensors, one per micro-batch")
        bad = next((m for m, t in enumerate(v) if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            raise MicrobatchError("type", f"{what} {i}: micro-batch {bad} is a {type(v[bad]).__name__}; a list of "
                                  "micro-batches holds one Tensor per micro-batch")
    return [tuple(None if v is None else v[m] for v in values) for m in range(n)]


def _split_batched(values: Sequence[Any], n: int, dim: int, what: str, allow_uneven: bool) -> list[tuple]:
    """Split every tensor of ``values`` into ``n`` equal micro-batches along ``dim`` (None stays None).

    A size that ``n`` does not divide is refused unless ``allow_uneven`` (then the first
    ``size % n`` micro-batches get one row more, as ``torch.tensor_split`` does).
    """
    per_value = []
    for v in values:
        if v is None:
            per_value.append([None] * n)
            continue
        if v.dim() <= dim or v.shape[dim] < n:
            size = "no such dim" if v.dim() <= dim else f"size {v.shape[dim]}"
            raise MicrobatchError("split", f"{what} of shape {tuple(v.shape)} cannot be split into {n} micro-batches "
                                  f"along batch_dim={dim} ({size}); it needs at least {n} rows there")
        if v.shape[dim] % n and not allow_uneven:
            raise MicrobatchError("split", f"{what} of shape {tuple(v.shape)}: a batch of {v.shape[dim]} along "
                                  f"batch_dim={dim} does not split into num_chunks={n} equal micro-batches; use a "
                                  f"batch size divisible by {n} (or set allow_uneven=True on the Pipeline)")
        per_value.append(list(torch.tensor_split(v, n, dim)))
    return [tuple(p[i] for p in per_value) for i in range(n)]


def replica_share(values: Sequence[Any], replica: int, replicas: int, dim: int, what: str, label: str) -> tuple:
    """This data-parallel replica's rows of a global batch: of every tensor, or of every micro-batch of a list."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple)):
            out.append([replica_slice((t,), replica, replicas, dim, f"{what} {i}, micro-batch {m},", label)[0]
                        for m, t in enumerate(v)])
        else:
            out.append(replica_slice((v,), replica, replicas, dim, what, label)[0])
    return tuple(out)


def joined(per_mb: list[tuple[torch.Tensor, ...]], dim: int, ragged: bool) -> Any:
    """The outputs of the micro-batches: a list per output for a ragged step (one tensor per micro-batch),
    else concatenated along ``dim`` where they can be.

    An output of a batched step that is 0-dim or whose shape varies between micro-batches (other
    than along ``dim``) comes back as a list with one tensor per micro-batch too.
    """
    joined = []
    for i in range(len(per_mb[0])):
        parts = [o[i] for o in per_mb]
        shapes = {p.shape[:dim] + p.shape[dim + 1:] if p.dim() > dim else None for p in parts}
        can_cat = not ragged and None not in shapes and len(shapes) == 1
        joined.append(torch.cat(parts, dim) if can_cat else parts)
    return joined[0] if len(joined) == 1 else tuple(joined)
