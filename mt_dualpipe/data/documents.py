"""Fine-tuning documents: token ids and which of them the model learns to predict.

A record is a (prompt, response) pair, each side a string (encoded with a tokenizer from
``text.load_tokenizer``: a ``tokenizer.json`` through the ``tokenizers`` library, or bytes) or a
list of token ids. Its document is ``prompt + response + [end]``: the response and the end token
are targets, the prompt is not (its labels become -100, so the loss never trains the model to
write prompts). The two sides are encoded separately and joined as ids, so a tokenizer cannot
merge the last prompt token with the first response token into one that belongs to neither.

The end token (the tokenizer's end-of-text token by default) is what separates documents when
they are packed into one row: the model learns to end a response with it, and sees it before the
next document begins, as in pretraining text (``text.token_stream``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .text import Tokenizer

IGNORE_INDEX = -100
"""The label of a position that is not trained on (the loss's ``ignore_index``, ``layers.lm_loss``)."""


@dataclass(frozen=True)
class Document:
    """One training document: ``ids`` and, per id, whether it is a prediction target.

    Packed, a document of n tokens gives n input positions whose labels are the next token of
    the same document where that token is a target, and -100 elsewhere (the last position has no
    next token in the document), so ``num_targets`` counts the targets after the first token.
    """

    ids: tuple[int, ...]
    targets: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.targets):
            raise ValueError(f"a document has {len(self.ids)} ids but {len(self.targets)} target flags; give one "
                             "flag per id")
        if not self.ids:
            raise ValueError("a document needs at least one token")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_targets(self) -> int:
        """The labels this document contributes (its targets after the first token)."""
        return sum(self.targets[1:])

    def labels(self) -> list[int]:
        """Position i's label: ``ids[i + 1]`` where it is a target, else -100 (always at the last position)."""
        return [nxt if flag else IGNORE_INDEX for nxt, flag in zip(self.ids[1:], self.targets[1:])] + [IGNORE_INDEX]

    def truncated(self, max_tokens: int) -> Document:
        """The first ``max_tokens`` tokens (for a document longer than a packed row or a token budget)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return Document(self.ids[:max_tokens], self.targets[:max_tokens])


def _ids(side: str | Sequence[int], tokenizer: Tokenizer | None, what: str) -> list[int]:
    if isinstance(side, str):
        if tokenizer is None:
            raise ValueError(f"the {what} is a string but no tokenizer was given; pass tokenizer= "
                             "(mt_dualpipe.data.text.load_tokenizer) or token ids")
        return list(tokenizer.encode(side))
    ids = list(side) if isinstance(side, Sequence) else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"the {what} must be a string or a list of non-negative token ids, got {side!r:.80}")
    return ids


def prompt_response(prompt: str | Sequence[int], response: str | Sequence[int], tokenizer: Tokenizer | None = None,
                    end_id: int | None = None) -> Document:
    """The document ``prompt + response + [end]`` with the response and the end token as targets.

    ``end_id``: the token closing the response (default: the tokenizer's end-of-text token, if any;
    without either, no end token).
    """
    end = end_id if end_id is not None else getattr(tokenizer, "eos_id", None)
    p, r = _ids(prompt, tokenizer, "prompt"), _ids(response, tokenizer, "response")
    tail = [] if end is None else [int(end)]
    return Document(tuple(p + r + tail), (False,) * len(p) + (True,) * (len(r) + len(tail)))


def encode_records(records: Iterable[Sequence[Any] | Mapping[str, Any]], tokenizer: Tokenizer | None = None, *,
                   end_id: int | None = None) -> list[Document]:
    """One ``Document`` per record: a (prompt, response) pair or a mapping with "prompt" and "response"."""
    docs = []
    for i, rec in enumerate(records):
        if isinstance(rec, Mapping):
            missing = {"prompt", "response"} - set(rec)
            if missing:
                raise ValueError(f"record {i} lacks {', '.join(sorted(missing))}; a record maps 'prompt' and "
                                 "'response' (or is a (prompt, response) pair)")
            prompt, response = rec["prompt"], rec["response"]
        elif isinstance(rec, (tuple, list)) and len(rec) == 2:
            prompt, response = rec
        else:
            raise ValueError(f"record {i} is a {type(rec).__name__}; a record is a (prompt, response) pair or a "
                             "mapping with 'prompt' and 'response'")
        docs.append(prompt_response(prompt, response, tokenizer, end_id))
    return docs
