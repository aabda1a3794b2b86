"""``torch.compile``'d regions in a stage: what the B/W split needs from a compiled backward.

AOTAutograd turns a compiled region into one autograd node (``CompiledFunctionBackward``) whose
backward computes every gradient of the region at once. The split needs the opposite for the
expensive part: a weight-gradient GEMM must be its own work, runnable at W. So, for every compiled
region of a stage (``torch.compile(module)`` or ``module.compile()``, a block or the whole stage):

- **its matrix products stay out of the graph**: each ``nn.Linear`` inside (and each module that
  defers its weight gradient, ``supports_deferred_weight_grad``) runs its forward eagerly
  (``torch.compiler.disable``), so dynamo compiles the memory-bound work between them (norms,
  activations, residuals: what fusion speeds up) and the linears keep their own autograd nodes,
  which the generic split divides into B and W exactly as in eager, and whose deferring versions
  still queue their GEMMs in the ``WeightGradStore``. A compiled piece's remaining weights (a norm's)
  get their gradients in B, captured and accumulated at W (``backward.py``): each compiled backward
  runs once.
- **no buffer donation**: AOTAutograd may let a compiled backward overwrite its saved buffers,
  which it allows only in a backward that frees its graph; the split's B keeps the graph for W.
  The stage's forward (when compilation happens) runs with
  ``torch._functorch.config.donated_buffer`` off, so nothing is asked of the user.

The forwards are swapped on the instances (``module.forward``), before the region first runs; the
parameters, state dict and numerics are unchanged. A region compiled and run before the
``Pipeline`` was built recompiles once at its first step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn


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


def keep_products_eager(module: nn.Module) -> int:
    """Run every linear inside a compiled region of ``module`` outside the graph; returns how many."""
    done = 0
    seen: set[int] = set()
    for region in compiled_regions(module):
        for m in region.modules():
            if _product(m) and id(m) not in seen and not getattr(m.forward, "_mt_eager", False):
                seen.add(id(m))
                eager = torch.compiler.disable(m.forward, recursive=True)
                eager._mt_eager = True  # type: ignore[attr-defined]
                m.forward = eager  # an instance attribute: the class's forward and other instances are untouched
                done += 1
    return done


def without_buffer_donation() -> AbstractContextManager[Any]:
    """While a stage with compiled regions runs forward: AOTAutograd donates no saved buffer."""
    config = getattr(torch, "_functorch", None)
    config = getattr(config, "config", None)
    if config is None or not hasattr(config, "donated_buffer"):
        return nullcontext()  # an older torch without donation
    return config.patch(donated_buffer=False)
