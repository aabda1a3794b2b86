"""DeferredLinear: ``nn.Linear`` whose weight-gradient GEMM can wait for ``W``.

The zero-bubble split needs B to produce only the input gradient. For a linear layer that is one
GEMM (``dx = dy W``); the other (``dW = dyᵀ x``, plus the bias sum) is what W runs later. The
autograd function below does exactly the matmuls autograd does for ``F.linear`` (same calls, same
operand layouts), so results are bit-identical to ``nn.Linear``; the only difference is *when* the
weight gradient runs: inside a B with a ``WeightGradStore`` active it is queued as a closure that
accumulates into ``.grad`` (creating it if None) when W runs; otherwise it is returned to autograd
at once, as usual.

``defer_weight_grads(model)`` swaps a model's exact ``nn.Linear`` children for this class in
place, keeping the Parameter objects, so state dicts, names and optimizers built before are
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .weight_grad import WeightGradStore, deferrable_forward

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)  # one call instead of a device lookup


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run ``F.linear`` on ``x``'s device in, or None outside autocast."""
    if _any_autocast is not None and not _any_autocast():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Autocast's rule for one operand: floating tensors other than float64 go to ``dtype``."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


class _DeferredLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Under autocast, cast the operands the way autocast casts F.linear's and save them in that
        # dtype: the backward may run outside autocast (PyTorch's recommended pattern), where the
        # GEMMs of B and W must still see the forward's dtype.
        dtype = _autocast_dtype(x)
        w, b = weight, bias
        if dtype is not None:
            x, w, b = _cast(x, dtype), _cast(weight, dtype), _cast(bias, dtype)
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves: a deferred W writes their .grad
        ctx.dtype = dtype
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, bias, dtype = ctx.weight, ctx.bias, ctx.dtype
        need_x, want_w, want_b = ctx.needs_input_grad
        # A 2-D input (a routed expert's rows) needs no flattening: each reshape or view is an op call, as much
        # Python as a small layer's GEMM.
        flat = grad_out.dim() != 2
        dy = grad_out.reshape(-1, grad_out.shape[-1]) if flat else grad_out
        if dtype is not None:
            dy = _cast(dy, dtype)
        dx = None
        if need_x:
            dx = dy.mm(weight if dtype is None else _cast(weight, dtype))
            if flat:
                dx = dx.view(x.shape)
        want_b = want_b and bias is not None
        if not (want_w or want_b):
            return dx, None, None
        grads = _LinearWeightGrads(dy, x.reshape(-1, x.shape[-1]) if flat else x, want_w, want_b)
        store = WeightGradStore.active()
        if store is not None and (not want_w or weight.is_leaf) and (not want_b or bias.is_leaf):
            store.put_grads((weight, bias), grads)
            return dx, None, None
        dw, db = grads()
        return dx, dw, db


class _LinearWeightGrads:
    """A linear's weight and bias gradients from ``dy`` and its (2-D) input: what W runs, or B at once."""

    __slots__ = ("dy", "x", "want_w", "want_b")

    def __init__(self, dy: torch.Tensor, x: torch.Tensor, want_w: bool, want_b: bool) -> None:
        self.dy, self.x, self.want_w, self.want_b = dy, x, want_w, want_b

    def __call__(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dy = self.dy
        dw = dy.t().mm(self.x) if self.want_w else None  # autograd's layout for W = (Wᵀ)ᵀ
        db = dy.sum(0) if self.want_b else None
        return dw, db


_apply = super(torch.autograd.Function, _DeferredLinearFunction).apply
"""``_DeferredLinearFunction.apply`` without ``autograd.Function.apply``'s Python prologue, which only serves
functorch transforms (vmap, grad) and tracing: about a third of what the Function costs on CPU per call."""

_functorch_active = torch._C._are_functorch_transforms_active


class DeferredLinear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters, init and state dict) whose weight gradient may run at W.

    Deferred weight gradients are accumulated by autograd's own AccumulateGrad when W runs
    (``WeightGradStore.put_grads``), so ``register_post_accumulate_grad_hook`` fires once per W with
    the gradient (tensor hooks, ``register_hook``, see it too, at W); in a pipeline's B the
    parameters are not engine targets, so nothing fires there.
    """

    supports_deferred_weight_grad = True

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> DeferredLinear:
        """A DeferredLinear that shares ``linear``'s parameter objects (and hooks-free state)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if not torch.is_grad_enabled() or not deferrable_forward() or not (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
            # nothing to differentiate, or a backward the runtime runs fused (weight_grad.fused_forward): the
            # plain node, whose backward autograd runs in C++ (same matmuls, same results)
            return F.linear(x, weight, bias)
        if _functorch_active() or torch.compiler.is_compiling():
            return _DeferredLinearFunction.apply(x, weight, bias)  # the Python entry, which those need
        return _apply(x, weight, bias)


def defer_weight_grads(module: nn.Module, skip: Iterable[str] | Callable[[str, nn.Module], bool] | None = None
                       ) -> nn.Module:
    """Swap every exact ``nn.Linear`` inside ``module`` for a ``DeferredLinear``, in place; returns ``module``.

    ``skip``: qualified names to keep as they are (or a predicate on (name, module)). Subclasses of
    ``nn.Linear`` are left alone (they may carry their own forward). The swapped layers reuse the
    original Parameter objects, so optimizers built before keep working.
    """
    if type(module) is nn.Linear:
        raise TypeError("defer_weight_grads swaps the linears inside a model in place; "
                        "wrap a bare nn.Linear with DeferredLinear.from_linear(linear) instead")
    if skip is None:
        def keep(name: str, m: nn.Module) -> bool:
            return False
    elif callable(skip):
        keep = skip
    else:
        if isinstance(skip, str):
            raise TypeError(f"skip must be an iterable of qualified names, a predicate or None, not the string "
                            f"{skip!r}")
        names = set(skip)

        def keep(name: str, m: nn.Module) -> bool:
            return name in names
    targets = [(name, m) for name, m in module.named_modules() if type(m) is nn.Linear and not keep(name, m)]
    for name, m in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf, DeferredLinear.from_linear(m))
    return module
