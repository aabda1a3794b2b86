"""DualPipeV on local gloo ranks: DualPipe cut in half (one chain of 2P stages in a V, all inputs,
labels and losses on rank 0), one training step and one inference step checked against a
single-process run.

    python examples/example_dualpipev.py [--ranks 4] [--chunks 10]
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from toy_pipeline import PipelineStage, cos_diff, criterion, ref_step, spawn

from mt_dualpipe import DualPipeV


def main(rank: int, pp: int, port: int, num_chunks: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(233)
    rows, seq, hidden = 2, 4, 16
    full = nn.Sequential(*[PipelineStage(hidden) for _ in range(2 * pp)])
    full_x = torch.randn(num_chunks * rows, seq, hidden)
    full_l = torch.randn(num_chunks * rows, seq, hidden)
    loss_ref, out_ref = ref_step(full_x, full_l, full, num_chunks, criterion)

    # rank r holds stage r (down the V) and stage 2P-1-r (back up)
    local_full = nn.Sequential(full[rank], full[2 * pp - 1 - rank])
    local = nn.Sequential(PipelineStage(hidden), PipelineStage(hidden))
    local.load_state_dict(local_full.state_dict())
    model = DualPipeV(local)

    x, lab = (full_x, full_l) if rank == 0 else (None, None)
    loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,))
    assert torch.equal(loss, loss_ref) if rank == 0 else loss is None
    assert outputs is None
    peak = model.peak_activations
    worst = max(cos_diff(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters()))
    assert worst < 1e-7, worst
    model.zero_grad()

    with torch.no_grad():
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(lab,),
                                   return_outputs=True)
    if rank == 0:
        assert torch.equal(loss, loss_ref) and torch.equal(outputs, out_ref)
    print(f"rank {rank}: loss and outputs equal the single-process run, gradient cos diff {worst:.1e}, "
          f"peak activations {peak}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="pipeline ranks")
    ap.add_argument("--chunks", type=int, default=10, help="micro-batches (>= 2 * ranks)")
    args = ap.parse_args()
    spawn(main, args.ranks, args.chunks)
    print(f"DualPipeV with {args.ranks} ranks, {args.chunks} micro-batches: OK")
