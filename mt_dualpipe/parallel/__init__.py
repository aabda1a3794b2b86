"""Hybrid parallelism around the pipeline: one pp x dp x ep x tp mesh and data-parallel gradient sync.

* ``mesh``: ``init_parallel(pp, dp, ep, tp)`` -> ``ParallelDims`` (groups, sub-meshes, the dense and
  expert gradient groups, mirrored-stage groups for DualPipe);
* ``grad_sync``: ``GradSync`` — bucketed asynchronous all-reduce / reduce-scatter of a stage's
  final gradients, posted by the schedule's REDUCE op rather than by autograd hooks;
* ``weight_kinds``: ``set_weight_kind`` / ``weight_kind`` — "expert" (sharded over ep) or "dense";
* ``zero``: ``ZeroOptimizer`` — ZeRO-1 sharded optimizer state over a ``GradSync("zero1")``;
* ``fsdp``: ``FSDPStageSync`` — FSDP2 stages kept unsharded through a split-backward step;
* ``checkpoint``: DCP save/load of ZeRO-1 state, reshardable across data-parallel sizes;
* ``tensor_parallel``: ``parallelize_llama_stage`` — a Llama stage's attention and SwiGLU split
  column-/row-wise over the mesh's tp dimension with ``torch.distributed.tensor.parallel``.
"""

from .checkpoint import load_training_state, load_zero_state_dict, save_training_state, zero_state_dict
from .fsdp import FSDPStageSync, fsdp_modules
from .grad_sync import DEFAULT_BUCKET_BYTES, MODES, GradSync, StageSync, TiedSync, stage_params
from .layout import ShardLayout
from .mesh import DIMS, ParallelDims, SyncGroup, default_device_type, init_parallel
from .tensor_parallel import full_parameters, llama_tp_plan, parallelize_llama_stage
from .weight_kinds import KINDS, set_weight_kind, weight_kind
from .zero import PipelineOptimizer, ZeroOptimizer, optimizer_state_bytes

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DIMS", "KINDS", "MODES", "FSDPStageSync", "GradSync", "ParallelDims",
    "PipelineOptimizer", "ShardLayout", "StageSync", "SyncGroup", "TiedSync", "ZeroOptimizer",
    "default_device_type", "fsdp_modules", "full_parameters", "init_parallel", "llama_tp_plan",
    "load_training_state", "load_zero_state_dict", "optimizer_state_bytes", "parallelize_llama_stage",
    "save_training_state", "set_weight_kind", "stage_params", "weight_kind", "zero_state_dict",
]
