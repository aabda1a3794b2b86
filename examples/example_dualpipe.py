"""DualPipe on local gloo ranks: a toy model, one training step and one inference step, checked
against a single-process run (the same checks as deepseek-ai/DualPipe's example, on CPU).

    python examples/example_dualpipe.py [--ranks 4] [--chunks 10]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from mt_dualpipe import DualPipe, WeightGradStore
from mt_dualpipe.runtime import run_backward


class LinearFunc(torch.autograd.Function):
    """A linear layer whose weight gradient can wait for W (the B/W split's fast path)."""

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
        store.put(weight_grad) if store is not None else weight_grad()
        return grad_out @ weight, None


class MyLinear(nn.Linear):
    supports_deferred_weight_grad = True

    def forward(self, x):
        return LinearFunc.apply(x, self.weight)


class PipelineStage(nn.Module):
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


def main(rank: int, pp: int, port: int, num_chunks: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(233)
    rows, seq, hidden = 2, 4, 16
    full = nn.Sequential(*[PipelineStage(hidden) for _ in range(pp)])
    full_x = torch.randn(num_chunks * rows, seq, hidden)
    full_l = torch.randn(num_chunks * rows, seq, hidden)
    loss_ref, out_ref = ref_step(full_x, full_l, full, num_chunks, criterion)

    # rank r holds stage r of the forward direction and stage P-1-r of the reverse one
    local_full = nn.Sequential(full[rank], full[pp - 1 - rank])
    local = nn.Sequential(PipelineStage(hidden), PipelineStage(hidden))
    local.load_state_dict(local_full.state_dict())
    model = DualPipe(local)

    first, last = rank == 0, rank == pp - 1
    x = full_x.chunk(2)[0] if first else full_x.chunk(2)[1] if last else None
    lab = full_l.chunk(2)[1] if first else full_l.chunk(2)[0] if last else None

    loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,))
    if first:
        assert torch.equal(loss, loss_ref.chunk(2)[1])
    elif last:
        assert torch.equal(loss, loss_ref.chunk(2)[0])
    else:
        assert loss is None
    assert outputs is None
    peak = model.peak_activations  # in-flight stage activations of this rank, as the simulator counts them
    model.sync_mirrored_grads()  # rank r and P-1-r hold copies of the same layers
    worst = max(cos_diff(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters()))
    assert worst < 1e-7, worst
    model.zero_grad()

    with torch.no_grad():
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,),
                                   return_outputs=True)
    if first:
        assert torch.equal(loss, loss_ref.chunk(2)[1]) and torch.equal(outputs, out_ref.chunk(2)[1])
    elif last:
        assert torch.equal(loss, loss_ref.chunk(2)[0]) and torch.equal(outputs, out_ref.chunk(2)[0])
    print(f"rank {rank}: loss and outputs equal the single-process run, gradient cos diff {worst:.1e}, "
          f"peak activations {peak}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks (even)")
    ap.add_argument("--chunks", type=int, default=10, help="micro-batches in total (even, >= 2 * ranks)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(main, args=(args.ranks, port, args.chunks), nprocs=args.ranks)
    print(f"DualPipe with {args.ranks} ranks, {args.chunks} micro-batches: OK")
