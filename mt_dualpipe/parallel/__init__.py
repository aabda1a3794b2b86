"""Hybrid parallelism around the pipeline: one pp x dp x ep x tp mesh and data-parallel gradient sync.

* ``device``: ``backend_for`` — gloo on cpu, NCCL on cuda, MCCL on musa (``torch_musa`` when installed);
* ``modes``: ``DP_MODES``, the data-parallel modes and what each runs with (one table, no torch);
* ``stage_sync``: ``StageGradSync``, the contract every gradient sync implements (the executor,
  the optimizer and resilience ask only it);
* ``mesh_roles``: a user's ``DeviceMesh`` read by its dimension names (torchtitan's, Megatron's);
* ``mesh``: ``init_parallel(pp, dp, ep, tp)`` (or ``init_parallel(mesh=user_mesh)``) -> ``ParallelDims``
  (groups, sub-meshes, the dense and expert gradient groups, mirrored-stage groups for DualPipe);
* ``grad_sync``: ``GradSync`` — bucketed asynchronous all-reduce / reduce-scatter of a stage's
  final gradients, posted by the schedule's REDUCE op rather than by autograd hooks;
* ``weight_kinds``: ``set_weight_kind`` / ``weight_kind`` — "expert" (sharded over ep) or "dense";
* ``zero``: ``ZeroOptimizer`` — ZeRO-1 sharded optimizer state over a ``GradSync("zero1")``;
* ``fsdp``: ``FSDPStageSync`` — FSDP2 stages kept unsharded through a split-backward step;
* ``zero_state`` / ``checkpoint``: ZeRO-1 state as FQN-named DTensors, and its DCP save/load,
  reshardable across data-parallel sizes;
* ``local_ranks``: ``spawn_local_ranks`` — a development run's ranks on one machine, forked from a
  server that imported torch once (what the examples launch with);
* ``tensor_parallel``: ``parallelize_llama_stage`` — a Llama stage's attention and SwiGLU split
  column-/row-wise over the mesh's tp dimension with ``torch.distributed.tensor.parallel``.

The names below resolve on first use (PEP 562), so importing one submodule — the runtime imports
``weight_kinds`` in every process — does not load DCP and DTensor (about a second per process).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "load_training_state": "checkpoint",
    "load_zero_state_dict": "checkpoint",
    "save_training_state": "checkpoint",
    "zero_state_dict": "checkpoint",
    "BACKENDS": "device",
    "backend_for": "device",
    "FSDPStageSync": "fsdp",
    "fsdp_modules": "fsdp",
    "DEFAULT_BUCKET_BYTES": "grad_sync",
    "GradSync": "grad_sync",
    "MODES": "grad_sync",
    "StageSync": "grad_sync",
    "TiedSync": "grad_sync",
    "stage_params": "grad_sync",
    "ShardLayout": "layout",
    "spawn_local_ranks": "local_ranks",
    "DIMS": "mesh",
    "ParallelDims": "mesh",
    "SyncGroup": "mesh",
    "default_device_type": "mesh",
    "from_device_mesh": "mesh",
    "init_parallel": "mesh",
    "DP_MODES": "modes",
    "DataParallelMode": "modes",
    "GroupUse": "stage_sync",
    "RetakesParameters": "stage_sync",
    "StageGradSync": "stage_sync",
    "SyncInfo": "stage_sync",
    "get_mode": "modes",
    "mode_for_zero_stage": "modes",
    "full_parameters": "tensor_parallel",
    "llama_tp_plan": "tensor_parallel",
    "parallelize_llama_stage": "tensor_parallel",
    "KINDS": "weight_kinds",
    "set_weight_kind": "weight_kinds",
    "weight_kind": "weight_kinds",
    "PipelineOptimizer": "zero",
    "ZeroOptimizer": "zero",
    "optimizer_state_bytes": "zero",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
