"""Which data-parallel group a parameter's gradient reduces over: its *weight kind*.

A model marks its routed-expert parameters (sharded over the mesh's ``ep`` group) as ``"expert"``;
everything else is ``"dense"`` (replicated over ``dp x ep``). The mark is a public attribute on the
``Parameter`` object itself, not a name pattern, so it survives ``split_model``, FSDP wrapping and
renaming, and the gradient sync (``grad_sync``, ``zero``) can read it without knowing the model.
See ``mesh.py`` for what each kind reduces over and why both divide by ``dp * ep``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

KINDS = ("dense", "expert")
"""Kinds of weights, by the group their gradients reduce over."""

ATTRIBUTE = "mt_weight_kind"
"""Name of the attribute ``set_weight_kind`` sets on each parameter."""


def check_kind(kind: str) -> str:
    """``kind`` itself when it is one of ``KINDS``; a ``ValueError`` naming the allowed kinds otherwise."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight kind {kind!r}; allowed: {', '.join(KINDS)}")
    return kind


def set_weight_kind(params_or_module: nn.Module | torch.Tensor | Iterable[torch.Tensor], kind: str) -> None:
    """Mark parameters as ``kind`` ("dense" or "expert"): a module's parameters, one tensor, or an iterable."""
    check_kind(kind)
    if isinstance(params_or_module, nn.Module):
        params: Iterable[torch.Tensor] = params_or_module.parameters()
    elif isinstance(params_or_module, torch.Tensor):
        params = (params_or_module,)
    else:
        params = params_or_module
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"set_weight_kind expects a module, a tensor or tensors, got {type(p).__name__}")
        setattr(p, ATTRIBUTE, kind)


def weight_kind(p: torch.Tensor) -> str:
    """The kind ``set_weight_kind`` gave ``p``; ``"dense"`` when it was never marked."""
    return getattr(p, ATTRIBUTE, "dense")
