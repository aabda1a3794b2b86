"""Packed documents: several documents in one row, told apart by their position ids.

Fine-tuning packs short documents into one row (``data.batching``, ``mode="pack"``) so that no
micro-batch is mostly padding. The row's position ids restart at 0 where each document begins, and
that is all a model is told: **a document begins wherever the position ids restart**, at a position
id of 0 or one that does not follow its predecessor by one (and at the start of each row). Given
position ids, the shared layer

- rotates each token by its own position id (``rope.cos_sin(..., positions=)``): RoPE restarts with
  every document, as if the document ran alone;
- keeps attention inside each document: query i sees key j only if j <= i and both lie in the same
  document (a block-diagonal causal mask, ``attention_core``), in the eager, recomputed and flash cores.

A packed document's logits and gradients are then those of the document run on its own (tested against
transformers document by document). Without position ids nothing changes: positions are 0..S-1 and
the mask is the plain causal one, bit for bit as before.

transformers (``masking_utils.find_packed_sequence_indices``) begins a document wherever a position id
does not follow its predecessor by one; the rule here adds a 0 that follows a -1, which no valid row
holds, so the two agree on every row transformers' ``DataCollatorWithFlattening`` or ``data.batching``
emits. Padding gets position ids 0, 1, ... of its own there, so it is a document of its own that no
real token attends to.

Labels: ``labels[:, i]`` is token i + 1, so the label at a document's last position would be the next
document's first token, which the model cannot see. It must be -100 (``data.documents`` puts -100 at
every document's last position); ``check_document_labels`` refuses labels that cross a document.

Between pipeline stages the position ids travel with the hidden states as ``hand_on(position_ids)``,
an int32 copy: int32 halves the message, and a last stage's criterion tells position ids (int32)
from labels (int64, what the cross-entropy takes), so a forgotten ``labels=`` fails with a message
instead of training on position ids (``criterion_inputs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INT_DTYPES = (torch.int64, torch.int32)


def check_position_ids(position_ids: torch.Tensor, shape: Sequence[int], where: str = "the model") -> None:
    """``position_ids`` must be an integer tensor of ``shape`` (batch, seq): one id per token."""
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"{where} takes position_ids as a (batch, seq) integer tensor, got a "
                         f"{type(position_ids).__name__}")
    if position_ids.dtype not in INT_DTYPES:
        raise ValueError(f"{where} takes position_ids as integers (int64 or int32), got a {position_ids.dtype} tensor")
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(f"{where}: position_ids have shape {tuple(position_ids.shape)} but the tokens "
                         f"{tuple(shape)}; give one position id per token, (batch, seq)")


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool: True where a document begins, at a position id of 0 or one that does not follow its
    predecessor by one (and at each row's first token)."""
    follows = position_ids[:, 1:] == position_ids[:, :-1] + 1
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = ~follows | (position_ids[:, 1:] == 0)
    return starts


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its document in its row (batch, seq), counted from 1 (``document_starts``)."""
    return document_starts(position_ids).cumsum(-1)


def hand_on(position_ids: torch.Tensor) -> torch.Tensor:
    """What a stage passes to the next with its hidden states: an int32 copy (a new tensor, so freeing a
    sent output never touches the stage's own input, which its recompute may still read)."""
    return position_ids.to(torch.int32, copy=True)


def check_document_labels(labels: torch.Tensor, position_ids: torch.Tensor, ignore_index: int = -100) -> None:
    """Refuse labels that cross a document: the label just before a document's first token must be ignored."""
    if labels.shape != position_ids.shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)} but position_ids {tuple(position_ids.shape)}; "
                         "give one label per token")
    crossing = document_starts(position_ids)[:, 1:] & (labels[:, :-1] != ignore_index)
    if bool(crossing.any()):
        row, col = (int(i) for i in crossing.nonzero()[0])
        raise ValueError(f"labels cross a document boundary: row {row}, position {col} is the last token of a "
                         f"document (a new one begins after it) but its label is {int(labels[row, col])}; a packed "
                         f"document's last label must be {ignore_index} (mt_dualpipe.data.documents does this)")


def criterion_inputs(rest: Sequence[torch.Tensor], where: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A last stage's criterion arguments after the hidden states: ``(labels,)`` or, for packed rows (the
    stage returned its position ids too), ``(position_ids, labels)`` -> (position_ids or None, labels)."""
    if len(rest) == 2:
        return rest[0], rest[1]
    if len(rest) == 1 and rest[0].dtype != torch.int32:
        return None, rest[0]
    if len(rest) == 1:
        raise TypeError(f"{where}: the criterion got position ids (the last stage returns them with the hidden "
                        "states for packed rows) but no labels; pass labels= to step() on this rank")
    raise TypeError(f"{where}: the criterion takes (hidden, labels) or, for packed rows, (hidden, position_ids, "
                    f"labels); got {len(rest) + 1} tensors")
