"""What a training loop sets or reads on every MoE layer (``moe.MoEBlock``) of a model, a stage or a list of
stages, whatever the family: the expert all-to-all timeout and EP group, the balance loss's gradient scale,
the expert weights' kind, the auxiliary-loss-free bias update and the expert-load statistics.

Each is per layer instance (two models in one process do not share them), so they are set by walking the
modules rather than by module-level switches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.weight_kinds import set_weight_kind
from .expert_parallel import ep_size
from .moe import MoEBlock
from .router import GroupLimitedRouter


def _modules(module: nn.Module | Sequence[nn.Module]) -> nn.Module:
    return module if isinstance(module, nn.Module) else nn.ModuleList(module)


def moe_layers(module: nn.Module | Sequence[nn.Module]) -> list[MoEBlock]:
    """The MoE blocks under ``module`` (a module or a list of stage modules), in module order."""
    return [m for m in _modules(module).modules() if isinstance(m, MoEBlock)]


def set_aux_loss_scale(module: nn.Module | Sequence[nn.Module], scale: float) -> int:
    """Gradient the balance loss receives per backward, for every MoE layer under ``module``: 1.0 when each
    micro-batch loss is backpropagated as is (the DualPipe convention), 1/M when the runtime divides losses
    by M micro-batches. Returns the layers set."""
    layers = moe_layers(module)
    for m in layers:
        m.aux_loss_scale = float(scale)
    return len(layers)


def set_timeout(module: nn.Module | Sequence[nn.Module], seconds: float) -> int:
    """Bound every expert all-to-all wait of the MoE layers under ``module`` to ``seconds``; returns how many
    layers changed. Keep it at most the pipeline's timeout, so ``Rewind``'s agreement, which waits the
    pipeline's timeout + 60 s, outlasts it."""
    seconds = float(seconds)
    if not seconds > 0:
        raise ValueError(f"the expert all-to-all timeout must be positive, got {seconds!r}")
    layers = moe_layers(module)
    for m in layers:
        m.dispatcher.timeout = seconds
    return len(layers)


def set_ep_group(module: nn.Module | Sequence[nn.Module], group: dist.ProcessGroup | None) -> int:
    """Point every MoE layer under ``module`` at ``group``, e.g. a fresh group over the same ranks after a
    failed all-to-all; returns how many layers changed. The group must have the size the experts were
    sharded for."""
    layers = moe_layers(module)
    for m in layers:
        if ep_size(group) != ep_size(m.dispatcher.group):
            raise ValueError(f"the new EP group has {ep_size(group)} ranks, the experts are sharded over "
                             f"{ep_size(m.dispatcher.group)}")
        m.dispatcher.group = group
    return len(layers)


def mark_expert_weights(module: nn.Module | Sequence[nn.Module]) -> int:
    """Mark the routed-expert parameters of every MoE layer under ``module`` as weight kind "expert"
    (``mt_dualpipe.parallel.set_weight_kind``): the pipeline then reduces their gradients over the
    expert-data-parallel group (dp) instead of dp x ep. ``MoEBlock`` marks its own; call this again after
    anything that replaces Parameter objects (loading a checkpoint onto the meta device, FP8 conversion).
    Returns the parameters marked."""
    params = [p for m in moe_layers(module) for p in m.experts.parameters()]
    set_weight_kind(params, "expert")
    return len(params)


def _bias_routers(module: nn.Module | Sequence[nn.Module]) -> list[GroupLimitedRouter]:
    return [m.gate for m in moe_layers(module) if isinstance(m.gate, GroupLimitedRouter)]


@torch.no_grad()
def update_expert_bias(module: nn.Module | Sequence[nn.Module], speed: float | None = None) -> None:
    """Auxiliary-loss-free balancing for every bias-corrected router under ``module``
    (``GroupLimitedRouter.update_bias``): b_i += γ·sign(mean load − load_i), then reset the counts.

    Call after the optimizer step, once the loads of every replica of a layer have been summed (DeepSeek-V3's
    ``sync_expert_load`` on a mesh), so all replicas move their bias identically."""
    for gate in _bias_routers(module):
        gate.update_bias(speed)


def dropped_fraction(module: nn.Module | Sequence[nn.Module], reset: bool = True) -> tuple[int, int]:
    """(dropped, routed) (token, expert) pairs over the MoE layers since the last reset (capacity only)."""
    layers = moe_layers(module)
    out = (sum(m.dropped_pairs for m in layers), sum(m.routed_pairs for m in layers))
    if reset:
        for m in layers:
            m.dropped_pairs = m.routed_pairs = 0
    return out


def max_violation(module: nn.Module | Sequence[nn.Module]) -> float:
    """Mean over the counting routers of max(load)/mean(load) − 1 (0 = perfectly balanced), from the current
    counts."""
    vals = [float(g.load.max() / g.load.mean() - 1) for g in _bias_routers(module) if g.load.sum() > 0]
    return sum(vals) / len(vals) if vals else 0.0
