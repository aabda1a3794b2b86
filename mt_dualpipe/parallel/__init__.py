"""Hybrid parallelism around the pipeline: one pp x dp x ep x tp mesh and data-parallel gradient sync.

* ``mesh``: ``init_parallel(pp, dp, ep, tp)`` -> ``ParallelDims`` (groups, sub-meshes, the dense and
  expert gradient groups, mirrored-stage groups for DualPipe);
* ``grad_sync``: ``GradSync`` — bucketed asynchronous all-reduce / reduce-scatter of a stage's
  final gradients, posted by the schedule's REDUCE op rather than by autograd hooks;
* ``zero``: ``ZeroOptimizer`` — ZeRO-1 sharded optimizer state over a ``GradSync("zero1")``;
* ``fsdp``: ``FSDPStageSync`` — FSDP2 stages kept unsharded through a split-backward step;
* ``checkpoint``: DCP save/load of ZeRO-1 state, reshardable across data-parallel sizes.
"""

from .checkpoint import load_training_state, load_zero_state_dict, save_training_state, zero_state_dict
from .fsdp import FSDPStageSync, fsdp_modules
from .grad_sync import DEFAULT_BUCKET_BYTES, MODES, GradSync, stage_params
from .layout import ShardLayout
from .mesh import DIMS, KINDS, ParallelDims, SyncGroup, default_device_type, init_parallel
from .zero import ZeroOptimizer, optimizer_state_bytes

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DIMS", "KINDS", "MODES", "FSDPStageSync", "GradSync", "ParallelDims", "ShardLayout",
    "SyncGroup", "ZeroOptimizer", "default_device_type", "fsdp_modules", "init_parallel", "load_training_state",
    "load_zero_state_dict", "optimizer_state_bytes", "save_training_state", "stage_params", "zero_state_dict",
]
