"""Training data that needs no download: a synthetic arithmetic-sequence task.

Real text (files or folders, a ``tokenizer.json``, packing, a held-out split) is
``mt_dualpipe.data.text``.

Synthetic sequences are t_i = (start + step·i) mod vocab with a random start and a step drawn from
a few values: the next token follows from the previous two (attention must find the step), and so
does the token after it, which gives MTP something to learn too.
"""

from __future__ import annotations

import torch

STEPS = (1, 2, 3, 5, 7, 11)


def synthetic_batch(vocab_size: int, batch: int, seq_len: int, generator: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (batch, seq_len) int64; labels are the tokens shifted by one."""
    start = torch.randint(0, vocab_size, (batch, 1), generator=generator)
    step = torch.tensor(STEPS)[torch.randint(0, len(STEPS), (batch, 1), generator=generator)]
    seq = (start + step * torch.arange(seq_len + 1)) % vocab_size
    return seq[:, :-1], seq[:, 1:]
