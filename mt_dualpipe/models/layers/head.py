"""Token embedding, the LM head (tied or not) and the next-token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import compute_dtype


def embedding(vocab: int, hidden: int) -> nn.Embedding:
    """``embed_tokens`` (transformers' name)."""
    return nn.Embedding(vocab, hidden)


def lm_head(hidden: int, vocab: int) -> nn.Linear:
    """``lm_head``: absent when the embeddings are tied (the head is then the embedding matrix)."""
    return nn.Linear(hidden, vocab, bias=False)


def logits(h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    return F.linear(h, head_weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy (``labels[:, i]`` is token i+1) in ``compute_dtype``; ``ignore_index``
    targets are masked out."""
    return F.cross_entropy(logits.flatten(0, 1).to(compute_dtype(logits)), labels.flatten(), ignore_index=ignore_index)
