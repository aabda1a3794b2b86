"""Shared DeepSeek-V3 test pieces: an F&B unit run as two sides (``runtime.overlap``) against F then B on the same
two stages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Model, build_stages
from mt_dualpipe.runtime.overlap import run_overlapped


def overlapped_equals_sequential(config, model: DeepSeekV3Model, x0: torch.Tensor, x1: torch.Tensor,
                                 y1: torch.Tensor) -> bool:
    """Run F(x0) on the first stage together with B of (x1, y1) through both stages, overlapped and not.

    Experts are sharded over the world group when a process group exists (real non-blocking all-to-alls with 2
    ranks, whose overlap points hand the unit from one side to the other).
    Asserts outputs, input-gradients and every parameter gradient are bit-identical; returns True.
    """
    results = []
    for overlapped in (False, True):
        first, last = build_stages(config, 2, source=model,
                                   ep_group=dist.group.WORLD if dist.is_initialized() else None)
        h1_in = first(x1).detach().requires_grad_()
        loss1 = last.criterion(last(h1_in), y1)
        if overlapped:
            out0 = run_overlapped(lambda first=first: first(x0), loss1.backward)
        else:
            out0 = first(x0)
            loss1.backward()
        grads = {n: p.grad.clone() for m in (first, last) for n, p in m.named_parameters() if p.grad is not None}
        results.append((out0.detach(), grads, h1_in.grad.clone()))
    (o_a, g_a, i_a), (o_b, g_b, i_b) = results
    assert torch.equal(o_a, o_b) and torch.equal(i_a, i_b) and g_a.keys() == g_b.keys()
    assert all(torch.equal(g_a[k], g_b[k]) for k in g_a)
    return True
