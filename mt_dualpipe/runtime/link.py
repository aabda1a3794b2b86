"""The pipeline's own gloo connections, and the board where a rank that fails a step says why.

Why a group of its own. A rank that raises in the middle of a step (in F, B or W) leaves its peers
blocked in point-to-point waits that nothing completes, and a gloo wait cannot be interrupted from
outside: ``Work`` has no abort, and a wait that times out closes every connection of its group. So
the pipeline's gloo traffic (the messages on a gloo pipeline, the shape metadata and the step's
agreements on any backend) runs on a ``ProcessGroupGloo`` that the pipeline alone owns, built on the
store of the user's group. A failing rank *closes* it: every peer blocked on that rank wakes at once
with "connection closed", closes its own in turn (so ranks blocked on *it* wake too) and raises.
The user's group is never touched, and the next step rendezvouses a fresh link (one more
*generation*), which every rank of the pipeline does at the same step because every rank closed
its link in the failed one. Stale sends and receives of the failed step die with the old link, so
they cannot be matched by the next step's messages.

Closing. gloo has no call that closes a group's connections (``abort`` and ``shutdown`` leave a
peer's waits blocked; dropping the object closes them only once the last pending work is gone), but
a receive whose wait times out makes gloo close every connection of the group. ``close`` does that
with a receive no peer ever sends (``CLOSING_TAG``) and a 1 ms wait, from the first peer whose
connection is still open (a receive on a connection a peer closed fails at once, closing nothing).

The board. Before it closes, a failing rank writes its error (rank, op and cause, as text) under
the step's key in the same store; a peer that wakes reads it there and names it in its own error.
Nothing is read or written on the store in a step that succeeds.
"""

from __future__ import annotations

import datetime
import itertools
from collections import defaultdict

import torch
import torch.distributed as dist

CLOSING_TAG = 2**31 - 1  # a tag no message uses: the receive that closes the link
_CLOSING_WAIT = datetime.timedelta(milliseconds=1)

_instances: defaultdict[str, itertools.count] = defaultdict(itertools.count)
"""Per user group: how many links this process has made on it. The n-th pipeline a rank builds on a
group is the n-th on every rank of it, so the count names the same link everywhere."""


def _store_of(group: dist.ProcessGroup) -> dist.Store:
    """The group's store, else the default group's (a group made without one of its own)."""
    try:
        store = group.get_group_store()
    except RuntimeError:
        store = None
    return store if store is not None else dist.group.WORLD.get_group_store()


class Link:
    """One pipeline's gloo link over ``size`` ranks (pipeline ranks are link ranks), opened lazily.

    ``group``: the user's process group, whose store the link rendezvouses through (its ranks are
    not used). ``open`` (at each step's start) builds the link if the last one was closed;
    ``close`` breaks it for every peer; ``report`` / ``reports`` are the board.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.rank, self.size = rank, size
        self.store = dist.PrefixStore(f"mt_dualpipe/link/{next(_instances[group.group_name])}/", _store_of(group))
        self.generation = 0
        self.pg: dist.ProcessGroupGloo | None = None
        self.timeout: float | None = None

    def open(self, timeout: float) -> dist.ProcessGroupGloo:
        """The link, rendezvoused first when the last generation was closed (every rank does so in the same step)."""
        pg = self.pg
        if pg is None:
            td = datetime.timedelta(seconds=timeout)
            pg = self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{self.generation}/", self.store), self.rank,
                                                 self.size, td)
            self.timeout = timeout
        elif timeout != self.timeout:
            pg.set_timeout(datetime.timedelta(seconds=timeout))
            self.timeout = timeout
        return pg

    @property
    def is_open(self) -> bool:
        return self.pg is not None

    def close(self) -> None:
        """Break every connection of the link, so peers blocked on this rank raise now; the next ``open`` makes
        a new generation. Does nothing when the link is closed already (a rank closes it once per failed step)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        self.generation += 1
        for peer in range(self.size):  # a receive from a peer whose connection is closed already fails at once
            if peer == self.rank:
                continue
            try:
                pg.recv([torch.empty(1)], peer, CLOSING_TAG).wait(_CLOSING_WAIT)
            except RuntimeError as exc:
                if "imed out" in str(exc):  # the expected timeout: gloo has closed every connection
                    return

    # ----- the board ---------------------------------------------------------------------------
    def report(self, step: int, text: str) -> None:
        """Say why this rank failed ``step`` (before closing, so a peer that wakes finds it). Best effort: a
        store that is gone (its host died) only costs the peers the cause in their error."""
        try:
            self.store.set(f"failed/{step}/{self.rank}", text)
        except (RuntimeError, ValueError):  # the store's host is gone
            pass

    def reports(self, step: int) -> dict[int, str]:
        """What the ranks that failed ``step`` said, by rank (read only after a failure)."""
        keys = [f"failed/{step}/{r}" for r in range(self.size)]
        out = {}
        try:
            for r, key in enumerate(keys):
                if self.store.check([key]):
                    out[r] = self.store.get(key).decode(errors="replace")
        except (RuntimeError, ValueError):
            pass
        return out
