"""ShardLayout: rank-major buckets whose shards are torch.chunk(dim 0) pieces of every parameter."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.parallel import ShardLayout

SHAPES = [(5, 3), (7,), (), (1, 4), (2, 2, 2)]


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    out.append(torch.randn(3, generator=g, dtype=torch.float32))  # another dtype: its own bucket
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 10**6])
def test_pack_unpack_and_shards_match_torch_chunk(world, bucket_bytes):
    params = _params()
    layout = ShardLayout(params, world, bucket_bytes)
    assert sorted(layout.slot_of) == list(range(len(params)))
    assert len(layout.buckets) == (len(params) if bucket_bytes == 1 else 2)
    for b, bucket in enumerate(layout.buckets):
        assert len({params[s.index].dtype for s in bucket.slots}) == 1
        full = layout.new_full(b, torch.device("cpu"))
        layout.pack(b, [params[s.index] for s in bucket.slots], full)
        for s, got in zip(bucket.slots, layout.unpack(b, full)):
            assert torch.equal(got, params[s.index])
        grid = full.view(world, bucket.shard_numel)
        for rank in range(world):
            for s, view in zip(bucket.slots, layout.shard_views(b, grid[rank], rank)):
                p = params[s.index]
                chunks = torch.chunk(p.reshape(-1) if p.dim() == 0 else p, world, dim=0)
                want = chunks[rank] if rank < len(chunks) else p.new_empty(0, *p.shape[1:])
                assert torch.equal(view, want), (s, rank)
        # padding is zero: the whole buffer sums to the parameters' sum
        assert torch.isclose(full.sum(), sum(params[s.index].sum() for s in bucket.slots).to(full.dtype))


def test_none_packs_zeros_and_bad_sizes():
    params = _params()[:2]
    layout = ShardLayout(params, 2, 10**6)
    full = layout.new_full(0, torch.device("cpu")) + 7
    layout.pack(0, [None, params[1]], full)
    a, b = layout.unpack(0, full)
    assert torch.equal(a, torch.zeros(5, 3, dtype=torch.float64)) and torch.equal(b, params[1])
    with pytest.raises(ValueError, match="group size must be >= 1, got 0"):
        ShardLayout(params, 0, 10)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        ShardLayout(params, 2, 0)
