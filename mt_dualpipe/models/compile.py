"""Compiling a model family's blocks the way the B/W split needs (``build_stages(..., compile=True)``).

What fusion buys on these models is in their memory-bound work: RMSNorm, RoPE, the SwiGLU product,
the attention softmax, residual adds. What the split needs is that the weight-gradient GEMMs stay
separate work that W runs: a compiled region becomes one autograd node whose backward computes all
of its gradients at once, and a ``DeferredLinear`` / ``FP8Linear`` traced into it would never
queue its GEMM in the ``WeightGradStore``. So:

- each family names its **compile targets**, the sub-modules of a block that hold the memory-bound
  work (its norms, its attention, its dense FFN or shared experts), and each is compiled in place
  (``module.compile()``: parameter names, state dicts and the single-process reference unchanged);
- every linear inside them is **split out of the graph's backward** (``runtime.compiled.split_products``):
  a ``DeferredLinear`` traces as the custom op ``mt_dualpipe::linear``, whose backward queues its
  weight GEMM for W exactly as in eager, so a target stays one graph and inductor fuses the
  elementwise work around the GEMMs; an ``FP8Linear`` runs outside the graph
  (``torch.compiler.disable``), keeping its own autograd Function;
- **recompute regions** (``models/recompute.py``) stay opaque to the enclosing graph: dynamo
  would otherwise trace ``torch.utils.checkpoint`` and its run counter into the graph (the
  recompute would then happen inside the compiled backward and the counter only at trace time).
  A region that is a method other than a module's ``forward`` is compiled on its own first (the
  recompute then re-runs the compiled code once, in B), and the checkpoint around it runs eagerly;
- routed experts and the MoE router / dispatch / combine stay eager: their row counts depend on the
  routing, so a compiled version would recompile (or go dynamic) with every new count;
- AOTAutograd's buffer donation is switched off by the runtime while a compiled stage runs
  (``runtime/compiled.py``): B keeps the graph for W (``retain_graph``), which donation forbids.

Compilation is lazy (at the first forward); a family's shapes are fixed per step, so a second step
compiles nothing new.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..runtime.compiled import split_products
from .recompute import DeclaresRecompute, apply_recompute

BACKENDS = ("inductor", "aot_eager", "eager")


def check_backend(backend: str | bool) -> str | None:
    """``compile=`` as given to ``build_stages``: False/None -> None (eager), True -> "inductor", or a
    backend name (``BACKENDS``: ``"aot_eager"`` checks the graphs without inductor's code generation)."""
    if backend is False or backend is None:
        return None
    if backend is True:
        return "inductor"
    if backend not in BACKENDS:
        raise ValueError(f"compile={backend!r}: give True, False or one of {BACKENDS}")
    return backend


def _regions(stage: nn.Module, policy: str) -> list[tuple[nn.Module, str]]:
    """The recompute regions ``policy`` will make in ``stage`` (as ``apply_recompute`` finds them)."""
    if policy == "none":
        return []
    return [(m, name) for layer in stage.modules() if isinstance(layer, DeclaresRecompute)
            for m, name, _ in layer.recompute_regions(policy)]


def compile_stage(stage: nn.Module, targets: Iterable[nn.Module], *, backend: str = "inductor",
                  recompute: str = "none", **options: Any) -> Counter:
    """Compile ``targets`` (sub-modules of ``stage``) in place for the B/W split and apply the
    ``recompute`` policy (in that order, which the regions need); returns ``apply_recompute``'s run
    counter. ``options`` go to ``torch.compile`` (``mode``, ``dynamic``, ...)."""
    targets = list(targets)
    inside = {id(m) for t in targets for m in t.modules()}
    regions = [(m, name) for m, name in _regions(stage, recompute) if id(m) in inside]
    for module, name in regions:
        if name != "forward":  # a compiled module's forward region would be traced by the module's own compile
            setattr(module, name, torch.compile(getattr(module, name), backend=backend, **options))
    for t in targets:
        t.compile(backend=backend, **options)
    split_products(stage)
    counts = apply_recompute(stage, recompute)
    for module, name in regions:  # the checkpoint runs eagerly around the compiled inside
        setattr(module, name, torch.compiler.disable(getattr(module, name), recursive=True))
    return counts


def compiled_targets(stage: nn.Module) -> list[nn.Module]:
    """The modules of ``stage`` compiled in place (``module.compile()``), outermost first."""
    return [m for m in stage.modules() if getattr(m, "_compiled_call_impl", None) is not None]
