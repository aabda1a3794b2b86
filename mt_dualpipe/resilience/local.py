"""``LocalPipeline``: the pipeline step signature on one process, without pipelining.

It runs the stage modules one after another on each micro-batch and back-propagates each
micro-batch's loss, so gradients are those of the sum of the micro-batch losses — what
``mt_dualpipe.Pipeline`` computes across ranks. It is the single-process reference for tests and
benchmarks and lets ``Rewind`` wrap a plain (or data-parallel) training loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn


class LocalPipeline(nn.Module):
    """``step(*inputs, num_chunks, criterion=None, labels=(), return_outputs=False) -> (loss, outputs)``."""

    def __init__(self, stage_modules: Sequence[nn.Module], batch_dim: int = 0):
        super().__init__()
        self.module = nn.ModuleList(stage_modules)
        self.batch_dim = batch_dim

    def _chunks(self, values: Sequence[torch.Tensor], n: int, what: str) -> list[tuple]:
        for v in values:
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{what} must be tensors, got {type(v).__name__}")
            if v.dim() <= self.batch_dim or v.shape[self.batch_dim] % n:
                raise ValueError(f"{what} of shape {tuple(v.shape)} cannot be split into {n} equal micro-batches "
                                 f"along dim {self.batch_dim}")
        return list(zip(*(torch.chunk(v, n, self.batch_dim) for v in values))) if values else [()] * n

    def step(self, *inputs: torch.Tensor, num_chunks: int, criterion: Callable | None = None,
             labels: Sequence[torch.Tensor] = (), return_outputs: bool = False) -> tuple[Any, Any]:
        mb_in = self._chunks(inputs, num_chunks, "inputs")
        mb_lab = self._chunks(tuple(labels), num_chunks, "labels")
        losses, outputs = [], []
        for x, y in zip(mb_in, mb_lab):
            out: Any = x
            for m in self.module:
                out = m(*out) if isinstance(out, tuple) else m(out)
            if criterion is not None:
                loss = criterion(*(out if isinstance(out, tuple) else (out,)), *y)
                if torch.is_grad_enabled():
                    loss.backward()
                losses.append(loss.detach())
            if return_outputs:
                outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
        loss_out = torch.stack(losses) if losses else None
        out_all = torch.cat(outputs, self.batch_dim) if return_outputs and outputs and \
            isinstance(outputs[0], torch.Tensor) else (outputs or None)
        return loss_out, out_all
