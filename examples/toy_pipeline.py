"""The toy model both DualPipe examples use, its single-process reference, and the local launcher.

Each stage is a two-layer MLP whose linears defer their weight gradient to W (the B/W split's
fast path, through ``WeightGradStore``), and whose class offers ``overlapped_forward_backward``
(the F&B hook of deepseek-ai/DualPipe's contract).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe import WeightGradStore
from mt_dualpipe.parallel.local_ranks import free_port, spawn_local_ranks
from mt_dualpipe.runtime import run_backward


class LinearFunc(torch.autograd.Function):
    """A linear layer whose weight gradient can wait for W (the B/W split's fast path)."""

    deferred = 0  # how many weight gradients went through a WeightGradStore (to show the split works)

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors

        def weight_grad():
            g = grad_out.flatten(0, -2).T @ x.flatten(0, -2)
            weight.grad = g if weight.grad is None else weight.grad + g

        store = WeightGradStore.active()
        if store is not None:
            LinearFunc.deferred += 1
            store.put(weight_grad)
        else:
            weight_grad()
        return grad_out @ weight, None


class MyLinear(nn.Linear):
    supports_deferred_weight_grad = True

    def forward(self, x):
        return LinearFunc.apply(x, self.weight)


class PipelineStage(nn.Module):
    hook_calls = 0  # how often the runtime ran an F&B pair through the hook below
    def __init__(self, hidden: int):
        super().__init__()
        self.linear1 = MyLinear(hidden, 4 * hidden, bias=False)
        self.linear2 = MyLinear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x)))

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        """The F of one micro-batch and the backward of another as one unit (here simply in turn)."""
        cls.hook_calls += 1
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target).clone()


def ref_step(x, labels, model, chunks: int, loss_fn: Callable):
    ys, losses = [], []
    for mx, ml in zip(x.chunk(chunks), labels.chunk(chunks)):
        y = model(mx)
        loss = loss_fn(y, ml)
        loss.backward()
        ys.append(y.detach())
        losses.append(loss.detach())
    return torch.stack(losses), torch.cat(ys)


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def spawn(fn: Callable, ranks: int, *args) -> None:
    """Run ``fn(rank, ranks, port, *args)`` on ``ranks`` local processes (gloo on 127.0.0.1)."""
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # no optimizer, no DTensor here: the ranks need torch.distributed and the runtime only (preloading the
    # default's torch._dynamo would cost ~2 s of CPU that no rank would have paid)
    spawn_local_ranks(fn, ranks, (ranks, port, *args), preload=("torch", "torch.distributed", "mt_dualpipe.runtime"))
