"""Load-balancing losses for MoE routers, and the autograd trick that adds them from inside a layer.

A balance loss is computed where the routing happens (any pipeline stage), but must reach the step's
total loss without travelling through the stage outputs. ``AuxLoss`` does it: an identity on the gate
weights whose backward also hands the loss its gradient (``scale``: 1.0 when each micro-batch's loss is
backpropagated as is, 1/M when the runtime averages M micro-batches), so the loss is differentiated as
part of the same backward, in B, wherever the layer lives.

``switch_balance_loss`` is the Switch Transformer / transformers (``load_balancing_loss_func``) form for
softmax routers: N·Σ_i f_i·P_i with f_i the fraction of (token, slot) pairs routed to expert i (out of
T tokens: Σ_i f_i = K) and P_i the mean router probability. DeepSeek-V3's sequence- and batch-wise
variants are in ``integrations/balancing.py``.
"""

from __future__ import annotations

import torch


class AuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward also gives ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def switch_balance_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """N·Σ_i f_i·P_i for one layer's tokens: ``probs`` (T, N) router probabilities (differentiated),
    ``indices`` (T, K) the chosen experts (counted, not differentiated). Equal to transformers'
    ``load_balancing_loss_func`` on one layer's logits without an attention mask."""
    tokens, n_experts = probs.shape
    counts = torch.bincount(indices.flatten(), minlength=n_experts).to(probs.dtype)
    return n_experts * (counts / tokens * probs.mean(0)).sum()
