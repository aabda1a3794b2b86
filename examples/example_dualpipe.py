"""DualPipe on local gloo ranks: a toy model, one training step and one inference step, checked
against a single-process run (the same checks as deepseek-ai/DualPipe's example, on CPU).

    python examples/example_dualpipe.py [--ranks 4] [--chunks 10]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from toy_pipeline import PipelineStage, cos_diff, criterion, ref_step, spawn

from mt_dualpipe import DualPipe


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
    spawn(main, args.ranks, args.chunks)
    print(f"DualPipe with {args.ranks} ranks, {args.chunks} micro-batches: OK")
