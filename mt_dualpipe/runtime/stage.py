"""Per-stage state of one rank: what F keeps for B, what B keeps for W, and the ops themselves.

A ``Stage`` wraps one stage module of one chain. Per micro-batch it holds the inputs (autograd
leaves, so B can return their gradients), the outputs (the roots of B) or the loss of a chain's
last stage, the input gradients until they are sent, and what W still has to do. Everything of a
micro-batch is dropped at its W (or BW), which is what frees its activations.

Split backward has two paths (see ``backward.py`` and ``weight_grad.py``): the fast path when every
parameter-holding module of the stage declares ``supports_deferred_weight_grad`` (B runs with the
pipeline's ``WeightGradStore`` active, W runs the queued closures), the generic path otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from .backward import backward_roots, full_backward, split_backward
from .errors import PipelineError
from .weight_grad import WeightGradStore


def _as_outputs(out: Any, where: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors, or a clear error."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out) and len(out) > 0:
        return tuple(out)
    kinds = type(out).__name__ if not isinstance(out, (tuple, list)) else \
        f"{type(out).__name__} of {', '.join(type(t).__name__ for t in out) or 'nothing'}"
    raise PipelineError(f"{where} returned a {kinds}; a stage must return a Tensor or a non-empty tuple/list of "
                        "Tensors (they are what is sent to the next stage)")


def supports_fast_split(module: nn.Module) -> bool:
    """True when every module owning parameters declares ``supports_deferred_weight_grad``."""
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(owners) and all(getattr(type(m), "supports_deferred_weight_grad", False) for m in owners)


class Stage:
    """One (chain, stage) of this rank: its module and the per-micro-batch state of a step."""

    def __init__(self, module: nn.Module, chain: int, stage: int, is_first: bool, is_last: bool,
                 store: WeightGradStore):
        self.module, self.chain, self.stage = module, chain, stage
        self.is_first, self.is_last = is_first, is_last
        self.store = store
        self.fast = supports_fast_split(module)
        self.name = f"stage (chain {chain}, stage {stage}) {type(module).__name__}"
        self.reset()

    def reset(self) -> None:
        self.inputs: dict[int, Sequence[torch.Tensor]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, list[torch.Tensor | None]] = {}
        self.pending_w: dict[int, Any] = {}
        self.free_after_send: dict[int, list[torch.Tensor]] = {}

    # ----- F ----------------------------------------------------------------------------------
    def forward(self, mb: int, inputs: Sequence[torch.Tensor], criterion: Callable | None,
                labels: Sequence[Any], training: bool, keep_outputs: bool) -> tuple[torch.Tensor, ...]:
        outs = _as_outputs(self.module(*inputs), f"{self.name}, micro-batch {mb},")
        self.finish_forward(mb, inputs, outs, None, criterion, labels, training, keep_outputs)
        return outs

    def finish_forward(self, mb: int, inputs: Sequence[torch.Tensor], outs: Any, loss: torch.Tensor | None,
                       criterion: Callable | None, labels: Sequence[Any], training: bool,
                       keep_outputs: bool) -> None:
        """Keep what B needs (inputs, outputs or loss) after the F of ``mb`` produced ``outs``."""
        outs = _as_outputs(outs, f"{self.name}, micro-batch {mb},")
        if training:
            self.inputs[mb] = inputs
        if self.is_last:
            if loss is None and criterion is not None:
                loss = criterion(*outs, *labels)
            if loss is not None:
                self.losses[mb] = loss
            if training and loss is None:
                raise PipelineError(f"{self.name} ends a chain but no criterion was given: a training step needs "
                                    "criterion on the ranks that hold a chain's last stage")
            if keep_outputs:
                self.outputs[mb] = tuple(o.detach() for o in outs)
        else:
            self.outputs[mb] = outs

    # ----- B / BW / W -------------------------------------------------------------------------
    def roots(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> tuple[list, list]:
        """The tensors B starts from: the loss of a last stage, else the outputs that got a grad."""
        if self.is_last:
            loss = self.losses[mb]
            return [loss], [torch.ones_like(loss)]
        return backward_roots(self.outputs[mb], grads)

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None] | None, split: bool) -> None:
        """B (``split``: weight gradients left for W) or BW; keeps the input grads for sending."""
        roots, gs = self.roots(mb, grads)
        inputs = self.inputs[mb]
        if not split:
            input_grads = full_backward(roots, gs, inputs)
        elif self.fast:
            with self.store.deferring((self.chain, self.stage, mb)):
                input_grads = full_backward(roots, gs, inputs)
            self.pending_w[mb] = "store"
        else:
            input_grads, w = split_backward(roots, gs, inputs)
            if w is not None:
                self.pending_w[mb] = w
        self.after_backward(mb, input_grads, split)

    def after_backward(self, mb: int, input_grads: list, split: bool) -> None:
        if not self.is_first:
            self.input_grads[mb] = input_grads
        if self.is_last:
            self.losses[mb] = self.losses[mb].detach()
        if not split:
            self._drop(mb)

    def weight(self, mb: int) -> None:
        """W: the weight gradients B left behind."""
        w = self.pending_w.pop(mb, None)
        if w == "store":
            for fn in self.store.pop((self.chain, self.stage, mb)):
                fn()
        elif w is not None:
            w.run()
        self._drop(mb)

    def _drop(self, mb: int) -> None:
        self.inputs.pop(mb, None)
        if not self.is_last:
            self.outputs.pop(mb, None)
