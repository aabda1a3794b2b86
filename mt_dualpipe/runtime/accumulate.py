"""Gradients into ``.grad`` the way autograd's ``AccumulateGrad`` puts them, with an engine call only where it matters.

A W holds gradients made for their parameters: the deferred weight gradients (``weight_grad.run_group``) and
the weights whose gradients the generic split's B computed (``backward._Split``). An engine call from the
parameters themselves lets ``AccumulateGrad`` add them, which is what tensor hooks and post-accumulate hooks
(FSDP2, optimizer-in-backward, gradient-sync hooks) observe; but the call costs far more than the addition on
small layers (on CPU, some 25 us; on CUDA it hands over to the device thread and back), and holding a W's worth
of fresh gradient buffers for one call made W on CPU slower than the whole fused backward. So a parameter that
nothing observes gets its gradient added directly, exactly what ``AccumulateGrad`` does with a gradient computed
under no_grad (stored when ``.grad`` is None, in the parameter's layout; added in place otherwise), and only
observed parameters go through the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_Variable = torch.autograd.Variable  # its engine is looked up per call (a counter or profiler may swap it)


def observed(p: torch.Tensor) -> bool:
    """Whether a hook sees ``p``'s accumulation: a tensor hook or a post-accumulate-grad hook."""
    return bool(getattr(p, "_backward_hooks", None)) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def add_to_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does with ``g`` (computed under no_grad, in ``p``'s dtype), for a parameter that no
    hook observes: stored when ``.grad`` is None (in ``p``'s layout), added in place otherwise."""
    if p.grad is None:
        p.grad = g if g.stride() == p.stride() else torch.empty_like(p).copy_(g)
    else:
        p.grad.add_(g)


def through_engine(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One engine call from the parameters: ``AccumulateGrad`` adds each gradient (a parameter listed twice gets
    the sum, and its post-accumulate hook fires once).

    The engine is called directly, not through ``torch.autograd.backward``, whose Python-side checks of every
    (tensor, gradient) pair cost about 25 us per linear on CPU, more than a small layer's weight GEMM: the
    gradients here are made for their parameters (same shape and dtype), and the engine still validates each
    root's gradient."""
    if pairs:
        _Variable._execution_engine.run_backward(tuple(p for p, _ in pairs), tuple(g for _, g in pairs), False,
                                                 False, (), True, True)


def accumulate(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``pairs`` into ``.grad``, each parameter listed once: directly where nothing observes it, the others in
    one engine call. Call it under ``torch.no_grad()``."""
    hooked = []
    for p, g in pairs:
        if observed(p):
            hooked.append((p, g))
        else:
            add_to_grad(p, g)
    through_engine(hooked)
