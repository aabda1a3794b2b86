"""Tiny fp64 models, the single-process reference and the per-rank worker shared by the runtime tests.

``pipeline_worker`` runs one step of a schedule on one rank; ``check_against_reference`` compares
every rank's losses, outputs and gradients with ``reference`` (the same layers on one process).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

H = 8
ROWS = 2  # rows per micro-batch


class MLPStage(nn.Module):
    def __init__(self, h: int = H):
        super().__init__()
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(2 * h, h)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def make_layers(n: int, seed: int = 0, cls=MLPStage) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [cls().double() for _ in range(n)]


def make_data(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(m * ROWS, H, generator=g, dtype=torch.float64))


def criterion(out, target):
    return F.mse_loss(out, target)


def reference(layers: list[nn.Module], x: torch.Tensor, labels: torch.Tensor, m: int):
    """Per-micro-batch losses, outputs, and the gradients of their sum, on one process."""
    layers = copy.deepcopy(layers)
    losses, outs = [], []
    for xm, lm in zip(torch.tensor_split(x, m), torch.tensor_split(labels, m)):
        h = xm
        for layer in layers:
            h = layer(h)
        loss = criterion(h, lm)
        loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    grads = [[p.grad.clone() for p in layer.parameters()] for layer in layers]
    return torch.stack(losses), outs, grads


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()


def chain_batch(sched, chain: int, x: torch.Tensor, m: int) -> torch.Tensor:
    parts = torch.tensor_split(x, m)
    return torch.cat([parts[i] for i in sched.microbatches_of(chain)])


def pipeline_worker(rank: int, world: int, sched, layers, x, labels, infer: bool = False):
    """Run one training step (and optionally an inference step) of ``sched``; return what the test checks."""
    from mt_dualpipe import Pipeline

    local = sched.local_stages(rank)
    mods = [copy.deepcopy(layers[s]) for _, s in local]
    pipe = Pipeline(mods, sched, timeout=30)
    m = sched.num_microbatches
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == rank]
    inp = (chain_batch(sched, first[0], x, m),) if first else ()
    lab = (chain_batch(sched, last[0], labels, m),) if last else ()
    loss, outs = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
    result = {"local": local, "loss": loss, "outputs": outs, "peak": pipe.peak_activations,
              "grads": [[p.grad for p in mod.parameters()] for mod in mods], "chain_end": last}
    if infer:
        with torch.no_grad():
            iloss, iouts = pipe.step(*inp, num_chunks=m, criterion=criterion, labels=lab, return_outputs=True)
        result["infer"] = (iloss, iouts)
        result["grads_after_infer"] = [[p.grad for p in mod.parameters()] for mod in mods]
    return result


def check_against_reference(sched, results, layers, x, labels, tol: float = 1e-12) -> None:
    """Losses bit-equal, outputs equal, every summed stage gradient within ``tol`` cosine difference."""
    m = sched.num_microbatches
    ref_loss, ref_outs, ref_grads = reference(layers, x, labels, m)
    n_stages = len(sched.placement[0])
    summed: dict[int, list] = {}
    for res in results:
        for (_, s), grads in zip(res["local"], res["grads"]):
            if s not in summed:
                summed[s] = [g.clone() for g in grads]
            else:
                summed[s] = [a + b for a, b in zip(summed[s], grads)]
        for c in res["chain_end"]:
            mbs = sched.microbatches_of(c)
            assert torch.equal(res["loss"], ref_loss[mbs]), f"{sched.name}: loss differs"
            assert torch.equal(res["outputs"], torch.cat([ref_outs[i] for i in mbs])), f"{sched.name}: outputs"
    assert sorted(summed) == list(range(n_stages))
    for s in range(n_stages):
        for g, r in zip(summed[s], ref_grads[s]):
            assert cos_diff(g, r) < tol, f"{sched.name} stage {s}: grad cos diff {cos_diff(g, r)}"
