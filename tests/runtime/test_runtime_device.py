"""Device and backend detection: cpu -> gloo, cuda -> nccl, musa -> mccl; the CPU path needs no
accelerator (the comm-stream helper is a no-op there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mt_dualpipe.parallel.device import backend_for, module_device, try_import_musa
from mt_dualpipe.runtime.streams import StreamSync


def test_backend_for_each_device_type():
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda:1") == "nccl"
    assert backend_for("musa:0") == "mccl"  # works without torch_musa installed
    with pytest.raises(ValueError, match="no point-to-point backend for device type 'meta'; supported: cpu, cuda"):
        backend_for("meta")


def test_module_device_and_cpu_stream_sync_are_no_ops():
    assert module_device([nn.Linear(2, 2)]) == torch.device("cpu")
    assert module_device([nn.GELU()]) == torch.device("cpu")
    sync = StreamSync(torch.device("cpu"))
    assert not sync.active and sync.comm_stream is None
    with sync.comm():
        pass
    assert sync.record() is None
    sync.consume(None, [torch.ones(1)])


def test_musa_is_optional():
    assert try_import_musa() in (True, False)
    if not hasattr(torch, "musa"):
        assert try_import_musa() is False


def test_collective_device_is_cpu_on_gloo(tmp_path):
    """Small tensors of a collective live where the group's backend takes them (cpu on gloo; on NCCL the
    current GPU: tests/cuda)."""
    import torch.distributed as dist

    from mt_dualpipe.parallel.device import collective_device

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert collective_device() == torch.device("cpu")
        assert collective_device(dist.new_group([0], backend="gloo")) == torch.device("cpu")
    finally:
        dist.destroy_process_group()
