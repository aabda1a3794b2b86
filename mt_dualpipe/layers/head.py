"""Token embedding, the LM head (tied or not) and the next-token loss (per call, or normalised by the step's
global count of valid targets)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.device import collective_device
from .common import compute_dtype


def embedding(vocab: int, hidden: int, padding_idx: int | None = None) -> nn.Embedding:
    """``embed_tokens`` (transformers' name). ``padding_idx`` (the config's ``pad_token_id``): as in transformers,
    that row gets no gradient from the lookup (a tied head still trains it) and starts at zero."""
    if padding_idx is not None and not 0 <= padding_idx < vocab:
        raise ValueError(f"pad_token_id {padding_idx} is outside the vocabulary 0..{vocab - 1}")
    return nn.Embedding(vocab, hidden, padding_idx)


def lm_head(hidden: int, vocab: int) -> nn.Linear:
    """``lm_head``: absent when the embeddings are tied (the head is then the embedding matrix)."""
    return nn.Linear(hidden, vocab, bias=False)


def logits(h: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    return F.linear(h, head_weight)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                   normalizer: float | torch.Tensor | None) -> torch.Tensor:
    flat = logits.reshape(-1, logits.size(-1)).to(compute_dtype(logits))
    if normalizer is None:
        return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index)
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum") / normalizer


class _KeptLogitsCrossEntropy(torch.autograd.Function):
    """The cross-entropy keeping the logits as given (the ``"loss"`` saver): eager autograd keeps the
    ``compute_dtype`` log-softmax (vocab × 4 bytes per token, twice the bf16 logits); B rebuilds it from the
    logits and differentiates the same ops, so the gradient is bit-equal."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                normalizer: float | torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index, ctx.normalizer = ignore_index, normalizer
        return _cross_entropy(logits, labels, ignore_index, normalizer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            loss = _cross_entropy(leaf, labels, ctx.ignore_index, ctx.normalizer)
        return torch.autograd.grad(loss, leaf, grad)[0], None, None, None


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
            normalizer: float | torch.Tensor | None = None, keep_logits: bool = False) -> torch.Tensor:
    """Next-token cross-entropy (``labels[..., i]`` is token i+1; any leading dims) in ``compute_dtype``;
    ``ignore_index`` targets are masked out.

    ``normalizer`` None: the mean over this call's valid targets. Otherwise the sum over them divided
    by ``normalizer``, the step's count of valid targets (``step_normalizer``): the micro-batches' losses
    then add up to the step's token mean, so a pipelined step's gradients equal one process's on the
    whole batch even when micro-batches hold different numbers of masked targets.
    ``keep_logits`` (the ``"loss"`` saver, ``savers.py``): keep the logits instead of the log-softmax."""
    if keep_logits and torch.is_grad_enabled() and logits.requires_grad:
        return _KeptLogitsCrossEntropy.apply(logits, labels, ignore_index, normalizer)
    return _cross_entropy(logits, labels, ignore_index, normalizer)


def count_targets(labels: torch.Tensor, ignore_index: int = -100) -> int:
    """The valid (not ``ignore_index``) targets in ``labels``."""
    return int((labels != ignore_index).sum())


def step_normalizer(labels: torch.Tensor, ignore_index: int = -100, group: dist.ProcessGroup | None = None,
                    replicas: int = 1) -> float:
    """The ``normalizer`` that makes a step's micro-batch losses sum to its global token mean.

    ``labels``: all of this step's labels this rank holds (every micro-batch). ``group``: the ranks whose
    labels together form the global batch (the last stage's data-parallel peers when each holds only its
    own share, ``dp_batch="local"``); their counts are summed. ``replicas``: how many data-parallel
    replicas average their gradients afterwards (the runtime's gradient sync divides by it), so the
    normalizer is the global count over ``replicas`` and the average comes out as the global mean.
    Torchtitan normalises the same way (global valid-token count), rather than per micro-batch.
    """
    count = torch.tensor([count_targets(labels, ignore_index)], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        count = count.to(collective_device(group))
        dist.all_reduce(count, group=group)
    total = float(count.item())
    if total == 0:
        raise ValueError("the step has no valid targets (every label is ignore_index); nothing to normalise by")
    return total / replicas
