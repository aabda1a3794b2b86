"""Documents into micro-batches by a token budget: packed rows or length buckets, little padding.

Fine-tuning documents vary in length by orders of magnitude (a log-normal spread is typical), so a
fixed number of rows per micro-batch either wastes most of a micro-batch on padding or runs out of
memory on the long ones. Here every micro-batch holds at most ``token_budget`` tokens, padding
included, its shape chosen for its documents; a step passes such micro-batches to
``Pipeline.step`` as lists (ragged micro-batches), so no two need the same shape.

* ``mode="pack"``: documents are packed into rows of at most ``seq_len`` tokens (best-fit
  decreasing, ``pack_documents``), ``token_budget // seq_len`` rows a micro-batch. Each row's
  position ids restart at 0 at every document, and no label crosses from one document into the
  next (what a model needs to keep packed documents apart; ``documents.py``).
* ``mode="bucket"``: one document a row; documents sorted by length are cut into micro-batches of
  as many rows as fit the budget at the longest one's length, so the rows of a micro-batch have
  nearly the same length.

Either way every document lands in exactly one row of one micro-batch; the micro-batches are then
shuffled (seeded). Padding (``pad_id`` inputs, -100 labels) fills a row to its micro-batch's
length; its position ids run from 0 of their own, so padding is never part of a document.
"""

from __future__ import annotations

import random
from array import array
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .documents import IGNORE_INDEX, Document

MODES = ("pack", "bucket")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``[rows, length]`` int64 tensors and which documents each row holds."""

    input_ids: torch.Tensor     # the documents' ids, then pad_id
    labels: torch.Tensor        # the next id of the same document where it is a target, else -100
    position_ids: torch.Tensor  # 0, 1, ... from each document's first token (and from the padding's)
    documents: tuple[tuple[int, ...], ...]  # per row, the indices of its documents, in row order
    tokens: int                 # the documents' tokens (the rest is padding)
    valid_tokens: int           # labels that are not -100: what the step's loss normaliser counts

    @property
    def padding(self) -> int:
        return self.input_ids.numel() - self.tokens


def padding_fraction(microbatches: Sequence[MicroBatch]) -> float:
    """Padded positions over all positions of ``microbatches``."""
    total = sum(mb.input_ids.numel() for mb in microbatches)
    return sum(mb.padding for mb in microbatches) / total if total else 0.0


def _too_long(documents: Sequence[Document], limit: int, what: str) -> None:
    longest = max(range(len(documents)), key=lambda i: len(documents[i]), default=None)
    if longest is not None and len(documents[longest]) > limit:
        raise ValueError(f"document {longest} has {len(documents[longest])} tokens, more than {what}={limit}; "
                         f"shorten long documents (Document.truncated({limit})) or raise {what}")


def _tie_breaks(n: int, seed: int) -> list[int]:
    """A seeded random rank per document: equal lengths are taken in a different order per seed."""
    rank = list(range(n))
    random.Random(seed).shuffle(rank)
    return rank


def pack_documents(documents: Sequence[Document], seq_len: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Rows of document indices, each row's documents at most ``seq_len`` tokens together.

    Best-fit decreasing: the longest document first, each into the fullest row it still fits in
    (a new row when none has room), so few rows are left part-empty.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    _too_long(documents, seq_len, "seq_len")
    rank = _tie_breaks(len(documents), seed)
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: bisect finds the fullest row that fits
    for i in sorted(range(len(documents)), key=lambda i: (-len(documents[i]), rank[i])):
        n = len(documents[i])
        k = bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            room, row = seq_len - n, len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            room -= n
        if room > 0:
            insort(free, (room, row))
    return [tuple(r) for r in rows]


def microbatch(documents: Sequence[Document], rows: Sequence[Sequence[int]], pad_id: int = 0) -> MicroBatch:
    """The tensors of ``rows`` (document indices per row), each row padded to the longest."""
    length = max(sum(len(documents[d]) for d in row) for row in rows)
    ids, labels, positions = array("q"), array("q"), array("q")  # flat, row after row: one copy into torch
    tokens = valid = 0
    for row in rows:
        used = 0
        for d in row:
            doc = documents[d]
            ids.extend(doc.ids)
            doc_labels = doc.labels()
            labels.extend(doc_labels)
            positions.extend(range(len(doc)))
            used += len(doc)
            valid += len(doc_labels) - doc_labels.count(IGNORE_INDEX)
        ids.extend([pad_id] * (length - used))
        labels.extend([IGNORE_INDEX] * (length - used))
        positions.extend(range(length - used))
        tokens += used
    shape = (len(rows), length)
    return MicroBatch(_tensor(ids, shape), _tensor(labels, shape), _tensor(positions, shape),
                      tuple(tuple(r) for r in rows), tokens, valid)


def _tensor(values: array, shape: tuple[int, int]) -> torch.Tensor:
    return torch.frombuffer(values, dtype=torch.int64).view(shape).clone()


def _buckets(documents: Sequence[Document], token_budget: int, seed: int) -> list[list[tuple[int]]]:
    """One document a row, by length: as many rows as fit ``token_budget`` at the longest row's length."""
    _too_long(documents, token_budget, "token_budget")
    rank = _tie_breaks(len(documents), seed)
    groups: list[list[tuple[int]]] = []
    group: list[tuple[int]] = []
    for i in sorted(range(len(documents)), key=lambda i: (len(documents[i]), rank[i])):
        if group and (len(group) + 1) * len(documents[i]) > token_budget:  # sorted: document i is the longest
            groups.append(group)
            group = []
        group.append((i,))
    return groups + ([group] if group else [])


def assign_microbatches(documents: Sequence[Document], token_budget: int, *, mode: str = "pack",
                        seq_len: int | None = None, seed: int = 0) -> list[tuple[tuple[int, ...], ...]]:
    """Which documents go into which row of which micro-batch (``token_budget_batches`` without the tensors):
    per micro-batch, per row, the document indices; every document exactly once, micro-batches shuffled."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if not documents:
        raise ValueError("no documents given")
    if mode == "pack":
        seq_len = token_budget if seq_len is None else seq_len
        if not 1 <= seq_len <= token_budget:
            raise ValueError(f"seq_len must be between 1 and token_budget={token_budget}, got {seq_len}")
        rows = pack_documents(documents, seq_len, seed)
        random.Random(seed + 1).shuffle(rows)
        per = token_budget // seq_len
        groups = [tuple(rows[i: i + per]) for i in range(0, len(rows), per)]
    else:
        if seq_len is not None:
            raise ValueError("seq_len is the packed row length: only mode='pack' takes it")
        groups = [tuple(g) for g in _buckets(documents, token_budget, seed)]
    random.Random(seed + 2).shuffle(groups)
    return groups


def token_budget_batches(documents: Sequence[Document], token_budget: int, *, mode: str = "pack",
                         seq_len: int | None = None, seed: int = 0, pad_id: int = 0) -> list[MicroBatch]:
    """Every document in one micro-batch of at most ``token_budget`` tokens (padding included), shuffled.

    ``mode``: "pack" (rows of at most ``seq_len`` tokens, default ``token_budget``: one row a
    micro-batch) or "bucket" (one document a row, rows of similar length together). ``seed``
    orders equal lengths and shuffles the micro-batches.
    """
    groups = assign_microbatches(documents, token_budget, mode=mode, seq_len=seq_len, seed=seed)
    return [microbatch(documents, g, pad_id) for g in groups]
