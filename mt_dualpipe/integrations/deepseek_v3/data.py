"""Training data that needs no download: a synthetic arithmetic-sequence task, or any local text file.

Synthetic sequences are t_i = (start + step·i) mod vocab with a random start and a step drawn from
a few values: the next token follows from the previous two (attention must find the step), and so
does the token after it, which gives MTP something to learn too.
"""

from __future__ import annotations

from pathlib import Path

import torch

STEPS = (1, 2, 3, 5, 7, 11)


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (batch, seq_len) int64; labels are the tokens shifted by one."""
    start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
    step = torch.tensor(STEPS)[torch.randint(0, len(STEPS), (batch, 1), generator=generator)]
    seq = (start + step * torch.arange(seq_len + 1)) % vocab_size
    return seq[:, :-1], seq[:, 1:]


class TextCorpus:
    """Byte-level tokens of a local text file (vocabulary 256), sampled as random windows."""

    def __init__(self, path: str | Path) -> None:
        data = Path(path).read_bytes()
        if len(data) < 2:
            raise ValueError(f"corpus {path} is too small ({len(data)} bytes)")
        self.tokens = torch.tensor(list(data), dtype=torch.int64)

    def batch(self, batch: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus has {self.tokens.numel()} tokens; need more than seq_len + 1 = {seq_len + 1}")
        starts = torch.randint(0, self.tokens.numel() - seq_len - 1, (batch,), generator=generator)
        windows = torch.stack([self.tokens[s:s + seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
