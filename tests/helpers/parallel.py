"""Tiny fp64 models, data and single-process references for the data-parallel tests (tests/parallel).

Every data-parallel run is compared with ``reference``: the same model on one process over the
full global batch, loss = mean squared error over all global rows. A rank that sees ``rows`` of
those rows in ``micro`` micro-batches uses ``local_loss`` (sum of squared errors / the rows a
replica sees), so summing its micro-batch gradients and averaging over the replicas gives exactly
the reference gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn

H = 8
GLOBAL_ROWS = 16


class Block(nn.Module):
    def __init__(self, h: int = H):
        super().__init__()
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def make_model(seed: int = 0, blocks: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(blocks)]).double()


def global_batch(seed: int = 1, rows: int = GLOBAL_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64),
            torch.randn(rows, H, generator=g, dtype=torch.float64))


def local_loss(out: torch.Tensor, y: torch.Tensor, replica_rows: int) -> torch.Tensor:
    """This micro-batch's share of its replica's mean loss (so micro-batch grads sum exactly)."""
    return ((out - y) ** 2).sum() / (replica_rows * out.shape[-1])


def replica_rows(x: torch.Tensor, replica: int, replicas: int) -> slice:
    n = x.shape[0] // replicas
    return slice(replica * n, (replica + 1) * n)


def reference(steps: int, optimizer: str = "adamw", seed: int = 0, blocks: int = 2,
              batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Sequential:
    """The model after ``steps`` single-process steps over the full global batch (one per step)."""
    model = make_model(seed, blocks)
    opt = make_optimizer(optimizer, list(model.parameters()))
    for step in range(steps):
        x, y = batches[step] if batches else global_batch(1 + step)
        opt.zero_grad()
        local_loss(model(x), y, x.shape[0]).backward()
        opt.step()
    return model


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    raise ValueError(kind)


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Module-level factory (picklable) for ZeroOptimizer."""
    return make_optimizer("adamw", params)


def reference_grads(seed: int = 0, blocks: int = 2) -> list[torch.Tensor]:
    model = make_model(seed, blocks)
    x, y = global_batch(1)
    local_loss(model(x), y, x.shape[0]).backward()
    return [p.grad.clone() for p in model.parameters()]
