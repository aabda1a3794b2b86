"""Flat, rank-major gradient/parameter buckets with every parameter sharded along its first dim.

One layout serves both data-parallel modes. Each parameter is cut into ``W`` (group size) chunks
of ``ceil(rows / W)`` rows along dim 0 — exactly how ``torch.chunk`` and DTensor's ``Shard(0)``
cut it, and how FSDP2 shards a parameter — the last chunks possibly short or empty. A bucket is
one flat buffer viewed as ``(W, S)``: row ``j`` holds chunk ``j`` of every parameter of the bucket,
zero-padded to the full chunk size, so

* ``all_reduce`` of the buffer is plain DDP (the padding sums zeros), and
* ``reduce_scatter`` of the buffer hands rank ``j`` the summed chunk ``j`` of every parameter:
  a ZeRO-1 shard that is, parameter by parameter, the local piece of a ``Shard(0)`` DTensor.

That last property is why the shards are per parameter rather than slices of one flat
concatenation: a checkpoint can then name the optimizer state by parameter and DCP can reshard it
to any other data-parallel size (``checkpoint.py``). Buckets hold one dtype and at most
``bucket_bytes`` of padded data (a parameter larger than that gets a bucket of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its bucket."""

    index: int                  # position in the layout's parameter list
    shape: torch.Size
    rows: int                   # size of dim 0 (1 for a 0-d parameter)
    row_numel: int              # elements per row
    chunk_rows: int             # ceil(rows / W): rows per chunk
    offset: int                 # start of this parameter's chunk within a bucket row

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def local_rows(self, shard: int) -> int:
        """Rows of chunk ``shard`` that are real (not padding): torch.chunk / Shard(0) sizes."""
        return max(0, min(self.chunk_rows, self.rows - shard * self.chunk_rows))


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    slots: tuple[Slot, ...]
    shard_numel: int            # S: elements of one row of the (W, S) buffer


class ShardLayout:
    """The bucket layout of ``params`` for a group of ``world`` ranks (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], world: int, bucket_bytes: int):
        if world < 1:
            raise ValueError(f"group size must be >= 1, got {world}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.params = list(params)
        self.world = world
        self.buckets: list[Bucket] = []
        self.slot_of: dict[int, tuple[int, Slot]] = {}  # param index -> (bucket index, slot)
        open_: dict[torch.dtype, list[Slot]] = {}
        used: dict[torch.dtype, int] = {}
        for i, p in enumerate(self.params):
            rows = p.shape[0] if p.dim() > 0 else 1
            row_numel = p.numel() // rows if rows else 0
            chunk_rows = -(-rows // world)
            padded = chunk_rows * row_numel * world * p.element_size()
            if open_.get(p.dtype) and used[p.dtype] + padded > bucket_bytes:
                self._close(p.dtype, open_)
            slots = open_.setdefault(p.dtype, [])
            if not slots:
                used[p.dtype] = 0
            slots.append(Slot(i, p.shape, rows, row_numel, chunk_rows, sum(s.chunk_numel for s in slots)))
            used[p.dtype] += padded
        for dtype in list(open_):
            self._close(dtype, open_)

    def _close(self, dtype: torch.dtype, open_: dict[torch.dtype, list[Slot]]) -> None:
        slots = tuple(open_.pop(dtype))
        b = len(self.buckets)
        self.buckets.append(Bucket(dtype, slots, sum(s.chunk_numel for s in slots)))
        for s in slots:
            self.slot_of[s.index] = (b, s)

    def new_full(self, b: int, device: torch.device) -> torch.Tensor:
        """A zeroed ``(W * S,)`` buffer for bucket ``b``."""
        bucket = self.buckets[b]
        return torch.zeros(self.world * bucket.shard_numel, dtype=bucket.dtype, device=device)

    def pack(self, b: int, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
        """Write each slot's tensor (the parameter's shape; None = zeros) into the flat buffer ``out``."""
        bucket = self.buckets[b]
        grid = out.view(self.world, bucket.shard_numel)
        for slot, t in zip(bucket.slots, tensors):
            dst = grid[:, slot.offset: slot.offset + slot.chunk_numel]
            if t is None:
                dst.zero_()
                continue
            padded = out.new_zeros(self.world * slot.chunk_rows, slot.row_numel)
            padded[: slot.rows].copy_(t.detach().reshape(slot.rows, slot.row_numel))
            dst.copy_(padded.view(self.world, slot.chunk_numel))

    def unpack(self, b: int, full: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor (the parameter's shape) read back from the flat buffer ``full``."""
        bucket = self.buckets[b]
        grid = full.view(self.world, bucket.shard_numel)
        out = []
        for slot in bucket.slots:
            cols = grid[:, slot.offset: slot.offset + slot.chunk_numel].reshape(-1)
            out.append(cols[: slot.rows * slot.row_numel].view(slot.shape))
        return out

    def shard_views(self, b: int, shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views into a ``(S,)`` shard buffer: chunk ``rank`` of each slot's parameter, unpadded,
        shaped ``(local_rows, *shape[1:])`` (a 0-d parameter's chunk is shaped ``(1,)`` or ``(0,)``)."""
        bucket = self.buckets[b]
        views = []
        for slot in bucket.slots:
            n = slot.local_rows(rank)
            tail = tuple(slot.shape[1:]) if len(slot.shape) > 0 else ()
            views.append(shard[slot.offset: slot.offset + n * slot.row_numel].view(n, *tail))
        return views

    def padded_numel(self) -> int:
        return sum(self.world * b.shard_numel for b in self.buckets)
