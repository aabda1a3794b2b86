"""DeepSeekMoE from a ``DeepSeekV3Config``: the shared layer's ``MoEBlock`` with DeepSeek's router and options.

Nothing here computes: the block (``layers/moe.py``) and the router (``layers/router.py``
``GroupLimitedRouter``) are every family's. What is DeepSeek's own is the configuration (report §2.1.2,
§3.3.2): sigmoid affinities computed in float32 from float32 casts (as transformers), the selection-only
``e_score_correction_bias`` moved by auxiliary-loss-free balancing, group-limited top-k (or device-limited),
normalised gate weights times ``routed_scaling_factor``, one shared expert, the tiny sequence-wise balance
loss (and the batch-wise one, capacity, FP8 dispatch as config switches), and SwiGLUs whose products the
``"selective"`` policy leaves alone (DeepSeek-V3's selective recomputes MLA only).
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch import nn

from ...layers.expert_parallel import ep_size
from ...layers.mlp import SwiGLUMLP
from ...layers.moe import MoEBlock
from ...layers.router import GroupLimitedRouter
from .config import DeepSeekV3Config


def mlp(dim: int, inter_dim: int, recompute_product: bool = False) -> SwiGLUMLP:
    """DeepSeek-V3's dense SwiGLU FFN: the shared layer's, whose product the ``"selective"`` policy leaves
    alone."""
    return SwiGLUMLP(dim, inter_dim, recompute_product=recompute_product, selective=False)


def router(config: DeepSeekV3Config) -> GroupLimitedRouter:
    """The gate of one MoE layer; initialised like ``nn.Linear`` unless on the meta device, so a gate built on
    its own never routes on uninitialised memory (the model re-initialises it)."""
    c = config
    gate = GroupLimitedRouter(c.dim, c.n_routed_experts, c.n_activated_experts, scoring=c.scoring_func,
                              selection=c.topk_method, n_groups=c.n_expert_groups, topk_groups=c.n_limited_groups,
                              route_scale=c.route_scale, norm_topk_prob=c.norm_topk_prob,
                              device_groups=c.device_groups, device_limit=c.device_limit,
                              bias_update_speed=c.bias_update_speed, upcast=True, keep_input=c.saves("router"))
    if not gate.weight.is_meta:
        nn.init.kaiming_uniform_(gate.weight, a=math.sqrt(5))  # nn.Linear's default
    return gate


def moe_block(config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None) -> MoEBlock:
    """Shared plus routed experts (this rank's share over ``ep_group``; all of them without)."""
    c = config
    size = ep_size(ep_group)
    if c.n_routed_experts % size:
        raise ValueError(f"n_routed_experts ({c.n_routed_experts}) must be divisible by the expert-parallel "
                         f"group size ({size})")
    if c.device_limit and size > 1 and size % c.device_groups:
        raise ValueError(f"device-limited routing over {c.device_groups} devices needs an EP group whose "
                         f"size is a multiple of it, got {size}")
    return MoEBlock(c.dim, c.moe_inter_dim, router(c), shared_intermediate=c.n_shared_experts * c.moe_inter_dim,
                    ep_group=ep_group, sequence_balance_coef=c.balance_loss_weight,
                    batch_balance_coef=c.batch_balance_loss_weight, capacity_factor=c.capacity_factor,
                    capacity_priority=c.capacity_priority, fp8_dispatch=c.fp8_dispatch,
                    recompute_product=c.saves("swiglu"), weight_before_down=c.saves("combine"), selective=False)
