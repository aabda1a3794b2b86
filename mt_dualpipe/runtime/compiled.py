"""``torch.compile``'d regions in a stage: what the B/W split needs from a compiled backward.

AOTAutograd turns a compiled region into one autograd node (``CompiledFunctionBackward``) whose
backward computes every gradient of the region at once. The split needs the opposite for the
expensive part: a weight-gradient GEMM must be its own work, runnable at W. So, for every compiled
region of a stage (``torch.compile(module)`` or ``module.compile()``, a block or the whole stage):

- **its matrix products are split out of the graph's backward**: each ``nn.Linear`` and
  ``DeferredLinear`` inside becomes the custom op ``mt_dualpipe::linear`` on its detached weight while
  dynamo traces it (``linear_op.py``), so the region stays one graph and the op's backward queues the
  weight-gradient GEMM for W exactly as ``DeferredLinear`` does; any other product (a module that
  defers its own weight gradient with its own forward, ``FP8Linear``) runs its forward eagerly
  (``torch.compiler.disable``), outside the graph, keeping its own autograd node. A compiled piece's
  remaining weights (a norm's) get their gradients in B, captured and accumulated at W
  (``backward.py``): each compiled backward runs once.
- **no buffer donation**: AOTAutograd may let a compiled backward overwrite its saved buffers,
  which it allows only in a backward that frees its graph; the split's B keeps the graph for W.
  The stage's forward (when compilation happens) runs with
  ``torch._functorch.config.donated_buffer`` off, so nothing is asked of the user.

A stage the schedule gives no W op (every backward fused, ``schedules/fuse.py``) keeps its plain
linears in the graph as written, but not the other products: an ``FP8Linear``'s weight cache, traced,
is a guard on each layer's own parameter, so every block would compile a graph of its own (and a
dozen blocks would pass dynamo's recompile limit), where run outside they share one.

The forwards are swapped on the instances (``module.forward``), before the region first runs; the
parameters, state dict and numerics are unchanged. A region compiled and run before the
``Pipeline`` was built recompiles once at its first step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from . import linear_op


def _compiled(m: nn.Module) -> bool:
    """``torch.compile(m)``'s wrapper (its class lives in ``torch._dynamo``, which is not imported here
    unless compilation is in use) or a module compiled in place by ``m.compile()``."""
    return (type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")) or \
        getattr(m, "_compiled_call_impl", None) is not None


def compiled_regions(module: nn.Module) -> list[nn.Module]:
    """The compiled modules inside ``module`` (itself included), outermost first."""
    return [m for m in module.modules() if _compiled(m)]


def _product(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or bool(getattr(type(m), "supports_deferred_weight_grad", False))


def split_products(module: nn.Module, *, linears: bool = True) -> int:
    """Make every matrix product inside a compiled region of ``module`` splittable; returns how many.

    Plain linears (``linear_op.splittable``) become ``mt_dualpipe::linear`` when traced (``linears=False``,
    a stage without W ops: they stay as written); other products run outside the graph. The forwards are
    swapped on the instances (an instance attribute: the class's forward and other instances are
    untouched), once.
    """
    done = 0
    seen: set[int] = set()
    for region in compiled_regions(module):
        for m in region.modules():
            if not _product(m) or id(m) in seen:
                continue
            seen.add(id(m))
            swapped = getattr(m.forward, "__func__", None) is linear_op.traced_forward
            if swapped or getattr(m.forward, "_mt_eager", False):
                continue
            if linear_op.splittable(m):
                if not linears:
                    continue
                linear_op.use_op_when_compiled(m)
            else:
                eager = torch.compiler.disable(m.forward, recursive=True)
                eager._mt_eager = True  # type: ignore[attr-defined]
                m.forward = eager
            done += 1
    return done


def without_buffer_donation() -> AbstractContextManager[Any]:
    """While a stage with compiled regions runs forward: AOTAutograd donates no saved buffer."""
    config = getattr(torch, "_functorch", None)
    config = getattr(config, "config", None)
    if config is None or not hasattr(config, "donated_buffer"):
        return nullcontext()  # an older torch without donation
    return config.patch(donated_buffer=False)
