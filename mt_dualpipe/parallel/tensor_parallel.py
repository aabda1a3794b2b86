"""Tensor-parallel pipeline stages: Llama-style blocks split over the mesh's ``tp`` dimension.

A stage is tensor-parallelised with PyTorch's own ``torch.distributed.tensor.parallel`` (DTensor
parameters, ``parallelize_module``); this module only chooses the plan and checks that it fits.
``parallelize_llama_stage(stage, dims.submesh("tp"))`` applies Megatron's dense split to every
decoder block of the stage:

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each tp rank keeps ``1/tp`` of the
  query heads and of the key/value heads, contiguous, so grouped-query pairing stays local) and
  ``o_proj`` row-wise (its output all-reduced);
* SwiGLU MLP: ``gate_proj`` and ``up_proj`` column-wise, ``down_proj`` row-wise.

Everything else (embedding, norms, the head) stays a plain, replicated parameter: its input and
its gradient are the same on every tp rank (the row-wise all-reduce makes the residual stream
replicated, the column-wise input's backward all-reduces its gradient), so no tp-side reduction
is needed for it. This is torchtitan's dense plan without sequence parallelism or loss
parallelism (the last stage's criterion reads ``lm_head.weight`` directly, which a sharded head
would break); both are possible extensions, neither changes the pipeline contract below.

Pipeline contract (see docs/architecture.md, "Tensor parallel"): a stage's inputs and outputs
are plain local tensors. Each tp rank exchanges them with the pipeline neighbour at the same tp
coordinate (the mesh's ``pp`` group), and all tp ranks of a pipeline rank pass the same batch.
The styles' default ``use_local_output=True`` gives exactly that; the runtime refuses a DTensor
that would cross a pipeline boundary rather than guess its placement (a ``Partial`` value's local
part is not the output). ``DeferredLinear`` (``nn.Linear`` subclass) is accepted by
``parallelize_module`` and its autograd function runs on DTensor weights unchanged, so the B/W
split holds: B computes the input gradients and the tp all-reduces, W the weight-gradient GEMMs
on the local shards (no collective in W).

Data parallelism on top (``init_parallel(pp, dp, tp=...)``, ``dp_mode="allreduce"``) and
DualPipe's mirrored copies reduce each tp rank's *local* shards over the ranks at the same tp
coordinate: ``GradSync`` packs ``local_tensor(p.grad)`` and writes back through it
(``like_param`` when a gradient is missing). ZeRO-1 and FSDP over tensor-parallel parameters are
refused by the runtime (``runtime/data_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

ATTENTION_PLAN: dict[str, type[ParallelStyle]] = {
    "q_proj": ColwiseParallel, "k_proj": ColwiseParallel, "v_proj": ColwiseParallel, "o_proj": RowwiseParallel,
}
MLP_PLAN: dict[str, type[ParallelStyle]] = {
    "gate_proj": ColwiseParallel, "up_proj": ColwiseParallel, "down_proj": RowwiseParallel,
}
HEAD_COUNTS = ("heads", "kv_heads")
"""Attention attributes that count heads (``layers.attention.GQAttention``'s): each tp rank runs ``1/tp`` of them."""


def _has(module: nn.Module, names: Any) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in names)


def llama_blocks(stage: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The stage's attention modules (``q_proj`` .. ``o_proj``) and SwiGLU MLPs (``gate_proj`` .. ``down_proj``),
    found by Hugging Face's Llama names, with their qualified names."""
    attns = [(n, m) for n, m in stage.named_modules() if _has(m, ATTENTION_PLAN)]
    mlps = [(n, m) for n, m in stage.named_modules() if _has(m, MLP_PLAN)]
    return attns, mlps


def llama_tp_plan(stage: nn.Module) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of a Llama-style stage: qualified linear name -> style."""
    attns, mlps = llama_blocks(stage)
    plan: dict[str, ParallelStyle] = {}
    for blocks, table in ((attns, ATTENTION_PLAN), (mlps, MLP_PLAN)):
        for prefix, _ in blocks:
            for leaf, style in table.items():
                plan[f"{prefix}.{leaf}" if prefix else leaf] = style()
    return plan


def _check_fits(stage: nn.Module, tp: int, attns: list, mlps: list) -> None:
    """One clear error for a stage the split cannot divide evenly (or that is already split)."""
    if getattr(stage, "tp_size", None) is not None:
        raise ValueError(f"{type(stage).__name__} is already tensor-parallel (tp={stage.tp_size}); split it once")
    if not attns and not mlps:
        raise ValueError(f"{type(stage).__name__} has no Llama-style attention (q_proj, k_proj, v_proj, o_proj) or "
                         "MLP (gate_proj, up_proj, down_proj) to split over tp")
    for name, attn in attns:
        counts = {a: getattr(attn, a, None) for a in HEAD_COUNTS}
        if any(not isinstance(v, int) for v in counts.values()):
            raise ValueError(f"attention {name!r} ({type(attn).__name__}) has no integer head counts "
                             f"{', '.join(HEAD_COUNTS)}; the split needs them to run 1/tp of the heads per rank")
        bad = {a: v for a, v in counts.items() if v % tp}
        if bad:
            raise ValueError(f"attention {name!r}: head counts {bad} are not divisible by tp={tp}; every tp rank "
                             "needs whole query and key/value heads")
    for name, block in [*attns, *mlps]:
        for leaf in (*ATTENTION_PLAN, *MLP_PLAN):
            lin = getattr(block, leaf, None)
            if lin is None:
                continue
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"{name}.{leaf} is a {type(lin).__name__}; tensor parallel splits nn.Linear layers "
                                 "(DeferredLinear included), not FP8 or other custom linears")
            split = lin.out_features if ATTENTION_PLAN.get(leaf, MLP_PLAN.get(leaf)) is ColwiseParallel \
                else lin.in_features
            if split % tp:
                raise ValueError(f"{name}.{leaf}: {split} features are not divisible by tp={tp}")


def parallelize_llama_stage(stage: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split a Llama-style stage's attention heads and SwiGLU MLPs over ``tp_mesh`` (in place; returns it).

    ``tp_mesh`` is a 1-D mesh, ``ParallelDims.submesh("tp")``. Query and key/value head counts,
    ``intermediate_size`` and the attention width must be divisible by its size. Call it on the
    built stage (weights loaded; ``DeferredLinear`` swapped in or not) before building the
    ``Pipeline`` and the optimizer: the split linears' parameters become new ``DTensor``
    parameters, each rank holding its shard. Gather one with ``p.full_tensor()``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be a 1-D mesh (dims.submesh('tp')), got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    attns, mlps = llama_blocks(stage)
    _check_fits(stage, tp, attns, mlps)
    parallelize_module(stage, tp_mesh, llama_tp_plan(stage))
    for _, attn in attns:  # the views reshape the local projections into the local heads
        for a in HEAD_COUNTS:
            setattr(attn, a, getattr(attn, a) // tp)
    stage.tp_size = tp
    return stage


def tensor_parallel_params(module: nn.Module) -> list[str]:
    """Names of the module's DTensor parameters that live on a mesh of tp only (tensor-parallel shards)."""
    return [n for n, p in module.named_parameters()
            if isinstance(p, DTensor) and tuple(p.device_mesh.mesh_dim_names or ()) == ("tp",)]


@overload
def local_tensor(t: torch.Tensor) -> torch.Tensor: ...
@overload
def local_tensor(t: None) -> None: ...
def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (a view), any other tensor (or None) itself.

    What data parallelism reduces for a tensor-parallel weight: the dp (and mirrored-copy) peers at
    the same tp coordinate hold the same shard, so summing local shards over them is the sum of
    the full gradients, without a collective over tp."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a gradient for ``param``: a DTensor with its placements when it is one."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (DTensor shards gathered; collective over their meshes)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def dtensor_output_problem(outputs: Sequence[Any]) -> str | None:
    """Why these stage outputs cannot be sent to the next pipeline stage (None: they can).

    The runtime refuses DTensor outputs rather than converting them: what a tp rank may send is
    its local tensor, and whether that is the value depends on the placement (a ``Partial``
    output's local part is a partial sum; a ``Shard`` one is a slice the next stage's plan must
    declare as its input layout). Returning local tensors keeps that contract in the plans of both
    stages, where it is visible, instead of in a silent conversion on the wire.
    """
    bad = [(i, o.placements) for i, o in enumerate(outputs) if isinstance(o, DTensor)]
    if not bad:
        return None
    where = ", ".join(f"output {i} with placements ({', '.join(map(repr, pl))})" for i, pl in bad)
    return (f"the stage returned a DTensor ({where}); pipeline stages exchange plain local tensors with the "
            "neighbour at the same tp coordinate. Keep use_local_output=True (the default of ColwiseParallel / "
            "RowwiseParallel) on the stage's last layer, or return out.to_local() (a Shard/Replicate value) or "
            "out.full_tensor(); a stage may take DTensor inputs only through its plan's input_layouts")
