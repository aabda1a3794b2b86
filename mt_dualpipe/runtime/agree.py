"""The step's agreements (``comm.py``): a sum of one small integer vector per rank, every rank getting the total,
as a star over the pipeline's link: each rank sends its vector to pipeline rank 0, which adds them up and sends
the total back.

Why not ``allreduce`` on the link. A gloo all-reduce runs its ring of 2(P-1) dependent hops through the process
group's worker threads; on 4 gloo ranks sharing 2 cores one all-reduce of a few integers cost 5.7 ms of CPU
summed over the ranks (4.2 ms wall), the star 1.2 ms (0.9 ms wall): its P-1 messages in and P-1 out are posted
and waited on the caller's thread (``benchmarks/agreement_cost.py``). A step runs two agreements, and on a
machine with more ranks than cores every rank's CPU is another rank's wall time: against deepseek's DualPipe
on the same model (``benchmarks/vs_deepseek_dualpipe.py``, 4 ranks, deferred linears) the star took the CPU
per step from 1.025 / 1.006 of deepseek's (DualPipe / DualPipeV) to 0.979 / 0.986.

Failure behaves as with the all-reduce: every message is a receive or send on the link, so a rank that closes
its link (``link.py``) wakes whoever waits on it, and a wait that expires closes this rank's link in turn.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

START_TAG = 2**31 - 3
"""The step-start agreement's messages (``P2P.begin_step``); the data and metadata tags count up from 0."""
END_TAG = 2**31 - 2
"""The end-of-step agreement's messages (``P2P.finish``); ``link.CLOSING_TAG`` is the one above."""


class StarSum:
    """One agreement in flight: posted at construction (never blocks), the total in ``vec`` after ``wait``.

    ``pg``: the link (its ranks are pipeline ranks); ``vec``: this rank's int64 vector, overwritten by the
    sum of every rank's. Rank 0 adds up and answers inside its ``wait``; the others' ``wait`` returns once
    the answer is there.
    """

    def __init__(self, pg: Any, rank: int, size: int, tag: int, vec: torch.Tensor):
        self.pg, self.rank, self.size, self.tag, self.vec = pg, rank, size, tag, vec
        self.broken: RuntimeError | None = None  # posting on a link a peer closed fails at once: raised by wait
        self.works: list = []
        try:
            if rank == 0:
                self.parts = [torch.empty_like(vec) for _ in range(size - 1)]
                self.works = [pg.recv([p], src, tag) for src, p in enumerate(self.parts, 1)]
            else:
                self.total = torch.empty_like(vec)
                self.works = [pg.recv([self.total], 0, tag), pg.send([vec], 0, tag)]
        except RuntimeError as exc:
            self.broken = exc

    def wait(self, timeout: datetime.timedelta) -> bool:
        """Wait until ``vec`` holds the total; False if a wait expired (gloo closed the link then), and
        ``RuntimeError`` from gloo if the link broke (a peer closed it), as a collective's wait would."""
        if self.broken is not None:
            raise self.broken
        if not all(w.wait(timeout) is not False for w in self.works):
            return False
        if self.rank == 0:
            for p in self.parts:
                self.vec += p
            answers = [self.pg.send([self.vec], dst, self.tag) for dst in range(1, self.size)]
            return all(w.wait(timeout) is not False for w in answers)  # every peer's receive is already posted
        self.vec.copy_(self.total)
        return True
