"""A linear layer as one opaque op inside a compiled graph, its weight gradient left for W.

The split needs a linear's weight-gradient GEMM to be work of its own that W runs; AOTAutograd makes
a compiled region one autograd node whose backward computes everything at once. Keeping each linear
out of the graph (``torch.compiler.disable``) splits them but breaks the region into pieces between
the linears (three compiled calls per two-linear block, each with its own guards and Python
transitions), which made a compiled block slower than eager on small blocks. Instead, inside a
compiled region a linear becomes the custom op ``mt_dualpipe::linear``, which reads the layer's weight
and bias itself (they are not graph inputs), so dynamo keeps the whole region in one graph and the
compiled node has no autograd edge to the parameters. (With the weight as a graph input, detached
inside, the node would keep an edge to its AccumulateGrad, and autograd runs that with no gradient,
firing the parameter's post-accumulate hooks for nothing.)
Its backward is another custom op, ``mt_dualpipe::linear_backward``, which returns the input
gradient (``dy @ W``) and hands the weight gradient to the runtime the way ``DeferredLinear`` does:

* inside a split B (a ``WeightGradStore`` active) the GEMM ``dyᵀ x`` (and the bias sum) is queued for
  W, accumulated there by autograd's own AccumulateGrad (hooks, FSDP see it then);
* otherwise (a fused BW, a plain backward) it is computed and accumulated at once, the same way.

Custom ops take tensors and numbers only, so the op names its layer by a slot number and the
parameters are looked up here at run time (``_SLOTS``, process-wide because a compiled graph is;
FSDP2's unsharded parameters are what the layer holds while it runs). A queued
``dy`` is cloned: the compiled backward may reuse the buffer of an intermediate for later kernels
once its last use in the graph is done, and W runs after that.
"""

from __future__ import annotations

import itertools
import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .weight_grad import WeightGradStore, accumulate_now

_SLOTS: dict[int, weakref.ref[nn.Module]] = {}
_next_slot = itertools.count()


def _layer(slot: torch.Tensor) -> nn.Module:
    layer = _SLOTS[int(slot)]()
    if layer is None:
        raise RuntimeError(f"mt_dualpipe::linear: the layer of slot {slot} no longer exists")
    return layer


# Defined with ``torch.library.Library`` rather than ``custom_op``: a compiled graph calls these once per
# linear per micro-batch, and ``custom_op``'s Python wrapper costs about 10 us more per call on CPU.
_LIB = torch.library.Library("mt_dualpipe", "DEF")
_LIB.define("linear(Tensor x, Tensor slot, int out_features) -> Tensor")
_LIB.define("linear_backward(Tensor dy, Tensor x, Tensor slot) -> Tensor")


def linear(x: torch.Tensor, slot: torch.Tensor, out_features: int) -> torch.Tensor:
    """``F.linear`` with the weight and bias of the layer in ``slot``, read here, not passed in."""
    layer = _layer(slot)
    bias = None if layer.bias is None else layer.bias.detach()
    return F.linear(x, layer.weight.detach(), bias)


@torch.library.register_fake("mt_dualpipe::linear")
def _linear_fake(x: torch.Tensor, slot: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def linear_backward(dy: torch.Tensor, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The input gradient ``dy @ W``; the weight gradient queued for W or accumulated now (module doc)."""
    layer = _layer(slot)
    weight_p, bias_p = layer.weight, layer.bias
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dy2.mm(weight_p.detach()).view(x.shape)
    want_w, want_b = weight_p.requires_grad, bias_p is not None and bias_p.requires_grad
    store = WeightGradStore.active()
    held_dy = dy2.clone() if store is not None else dy2  # see the module doc: the graph may reuse dy's buffer
    x2 = x.reshape(-1, x.shape[-1])

    def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dw = held_dy.t().mm(x2) if want_w else None
        db = held_dy.sum(0) if want_b else None
        return dw, db

    if want_w or want_b:
        if store is not None:
            store.put_grads((weight_p, bias_p), weight_grads)
        else:
            accumulate_now((weight_p, bias_p), weight_grads)
    return dx


@torch.library.register_fake("mt_dualpipe::linear_backward")
def _linear_backward_fake(dy: torch.Tensor, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, slot, _ = inputs
    ctx.save_for_backward(x, slot)


def _backward(ctx: Any, dy: torch.Tensor) -> tuple:
    x, slot = ctx.saved_tensors
    return torch.ops.mt_dualpipe.linear_backward(dy, x, slot), None, None


_LIB.impl("linear", linear, "CompositeExplicitAutograd")
_LIB.impl("linear_backward", linear_backward, "CompositeExplicitAutograd")
torch.library.register_autograd("mt_dualpipe::linear", _backward, setup_context=_setup)


def splittable(m: nn.Module) -> bool:
    """Layers whose forward is exactly ``F.linear(x, weight, bias)``: ``nn.Linear`` and ``DeferredLinear``
    (subclasses with their own forward, FP8Linear say, are not)."""
    from .deferred import DeferredLinear

    return type(m) in (nn.Linear, DeferredLinear)


def traced_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward swapped onto a splittable layer (a bound method, so one graph serves every instance)."""
    if (torch.compiler.is_compiling() and torch.is_grad_enabled() and x.requires_grad
            and not torch.is_autocast_enabled(x.device.type)
            and (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad))):
        return torch.ops.mt_dualpipe.linear(x, self._mt_slot, self.out_features)
    return type(self).forward(self, x)


def use_op_when_compiled(m: nn.Module) -> None:
    """Swap ``m.forward`` (an instance attribute) for one that, while dynamo traces it in a training
    forward, emits ``mt_dualpipe::linear``; eager calls and everything else run the layer's own forward.

    The slot is a CPU tensor attribute (not a buffer: no state-dict entry, ``.to()`` leaves it), so
    dynamo makes it a graph input instead of guarding on its value: the blocks of a model share one
    compiled graph as they would without the swap. (A module deep-copied afterwards shares the
    original's slot: swap the copy again.)
    """
    slot = next(_next_slot)
    _SLOTS[slot] = weakref.ref(m)
    m._mt_slot = torch.tensor(slot, dtype=torch.int64)
    m.forward = types.MethodType(traced_forward, m)
