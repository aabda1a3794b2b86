"""Real text for the language-model demos: a tokenizer, local files streamed and packed, a held-out split.

* Tokenizer: a Hugging Face ``tokenizer.json`` (or a folder holding one) through the ``tokenizers``
  library — any BPE / WordPiece / Unigram tokenizer a model ships — or, without one, UTF-8 bytes
  (vocabulary 256). Documents (files) are separated by the tokenizer's end-of-text token when it
  has one.
* Corpus: files and/or folders (searched recursively, hidden files skipped, in sorted order). Files
  are read a block of whole lines at a time and tokenized block by block, so nothing ever holds
  the corpus — only a shuffle buffer of packed sequences and the last few batches.
* Packing: the token stream is cut into windows of ``seq_len + 1`` tokens, each starting on the
  last token of the one before, so every token is a label exactly once: inputs ``w[:-1]``, labels
  ``w[1:]``.
* Held-out split: window ``i`` (in corpus order) is for validation when ``i % val_every ==
  val_every - 1``; the split therefore does not depend on the seed, the batch size or the number
  of ranks, and the same text never lands in both.

Training batches are addressed by index (``train_batch(i)``): a training loop that rewinds to an
earlier step, or resumes from a checkpoint, gets the same batch for the same index. Recent
batches are cached; an index older than the cache replays the stream from the start.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""Special tokens taken as the document separator, in this order, when the tokenizer has them."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no file, vocabulary 256, no end-of-text token."""

    name = "bytes"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class FileTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        try:  # lazy: tokenizers is the optional 'text' extra, needed only for a tokenizer.json
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - the text extra is not installed
            raise ImportError("--tokenizer needs the 'tokenizers' package: pip install 'mt_dualpipe[text]'") from exc
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a tokenizer.json the tokenizers library can read: {exc}") from exc
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = (self._tok.token_to_id(t) for t in EOS_NAMES)
        self.eos_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer in ``path`` (a ``tokenizer.json`` or a folder with one), or bytes when None."""
    if path is None:
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: give a tokenizer.json file or a folder holding one")
    return FileTokenizer(p)


def corpus_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Every file named in ``paths`` plus every non-hidden file under a named folder (sorted)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*")
                           if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise ValueError(f"corpus folder {p} holds no files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"corpus path {p} is neither a file nor a folder")
    if not files:
        raise ValueError("no corpus files given")
    return files


def read_blocks(path: Path, block_chars: int = 1 << 20) -> Iterator[str]:
    """The text of ``path`` in blocks of whole lines of about ``block_chars`` characters (a longer line is
    split), so a block boundary never cuts a word that fits on a line."""
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        buf: list[str] = []
        size = 0
        while line := fh.readline(block_chars):
            buf.append(line)
            size += len(line)
            if size >= block_chars:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def token_stream(tokenizer: Tokenizer, files: Iterable[Path], block_chars: int = 1 << 20) -> Iterator[list[int]]:
    """Token blocks of every file in order, the end-of-text token (if any) after each file."""
    for path in files:
        for block in read_blocks(path, block_chars):
            yield tokenizer.encode(block)
        if tokenizer.eos_id is not None:
            yield [tokenizer.eos_id]


def pack(blocks: Iterable[Sequence[int]], window: int) -> Iterator[list[int]]:
    """Windows of ``window`` tokens over the concatenated blocks, each starting on the previous one's
    last token (so each token is predicted exactly once)."""
    if window < 2:
        raise ValueError(f"a packed window needs at least 2 tokens (one input, one label), got {window}")
    buf: list[int] = []
    for block in blocks:
        buf.extend(block)
        start = 0
        while len(buf) - start >= window:
            yield buf[start:start + window]
            start += window - 1
        del buf[:start]


class PackedText:
    """Packed, split, shuffled text: ``train_batch(i)`` and ``val_batch(i)`` as (inputs, labels) int64.

    ``rows`` sequences of ``seq_len`` tokens per batch. Training windows pass a seeded shuffle buffer
    of ``shuffle`` windows (re-seeded per epoch); the stream starts a new epoch when the corpus ends.
    At most ``max_val`` held-out windows are kept (the first ones), reused cyclically by ``val_batch``.
    """

    def __init__(self, paths: str | Path | Sequence[str | Path], seq_len: int, rows: int, *,
                 tokenizer: Tokenizer | None = None, val_every: int = 20, seed: int = 0, shuffle: int = 256,
                 cache: int = 64, max_val: int = 4096, block_chars: int = 1 << 20) -> None:
        if seq_len < 1 or rows < 1:
            raise ValueError(f"seq_len and rows must be >= 1, got seq_len={seq_len}, rows={rows}")
        if val_every < 2:
            raise ValueError(f"val_every must be >= 2 (every val_every-th window is held out), got {val_every}")
        self.files = corpus_files(paths)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.seq_len, self.rows, self.val_every, self.seed = seq_len, rows, val_every, seed
        self.shuffle, self.cache_size, self.max_val, self.block_chars = max(1, shuffle), max(1, cache), max_val, \
            block_chars
        self.val: list[list[int]] = []
        self.num_train = self.num_val = 0
        for _ in self._windows(keep_val=True):  # one pass: counts, the held-out windows, a size check
            self.num_train += 1
        if self.num_train == 0:
            raise ValueError(f"the corpus ({len(self.files)} file(s)) gives no training sequence of {seq_len + 1} "
                             f"tokens with every {val_every}th held out; add text or lower --seq-len")
        self._cache: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._stream: Iterator[list[list[int]]] | None = None
        self._next = 0  # index of the batch the stream yields next

    def _windows(self, keep_val: bool = False) -> Iterator[tuple[int, list[int]]]:
        blocks = token_stream(self.tokenizer, self.files, self.block_chars)
        for i, w in enumerate(pack(blocks, self.seq_len + 1)):
            if i % self.val_every == self.val_every - 1:
                if keep_val:
                    self.num_val += 1
                    if len(self.val) < self.max_val:
                        self.val.append(w)
                continue
            yield i, w

    def _train_batches(self) -> Iterator[list[list[int]]]:
        epoch, batch = 0, []
        while True:
            rng = random.Random(self.seed * 1000003 + epoch)
            pool: list[list[int]] = []
            for _, w in self._windows():
                pool.append(w)
                if len(pool) >= self.shuffle:
                    batch.append(pool.pop(rng.randrange(len(pool))))
                    if len(batch) == self.rows:
                        yield batch
                        batch = []
            rng.shuffle(pool)
            for w in pool:
                batch.append(w)
                if len(batch) == self.rows:
                    yield batch
                    batch = []
            epoch += 1

    @staticmethod
    def _tensors(windows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(windows, dtype=torch.int64)
        return t[:, :-1], t[:, 1:]

    def train_batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th training batch (the same tensors for the same index, whatever came before)."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        got = self._cache.get(index)
        if got is not None:
            return got
        if self._stream is None or index < self._next:
            self._stream, self._next = self._train_batches(), 0
        while self._next <= index:
            batch = self._tensors(next(self._stream))
            self._cache[self._next] = batch
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._next += 1
        return self._cache[index]

    def val_batch(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th held-out batch; the held-out windows repeat when there are fewer than asked for."""
        if not self.val:
            raise ValueError(f"the corpus gives no held-out sequence (every {self.val_every}th of "
                             f"{self.num_train} windows); add text or lower the split period")
        n = len(self.val)
        return self._tensors([self.val[(index * self.rows + k) % n] for k in range(self.rows)])
