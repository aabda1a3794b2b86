"""The batch layout: which images belong to which sample, and merging their features into the sequence.

Why padded image slots: a pipeline splits every input along dim 0 into micro-batches
(``torch.tensor_split``), so every input must be indexed by sample. transformers' flat
``(num_images, C, H, W)`` cannot be split that way once samples hold different numbers of images.
Here ``pixel_values`` is ``(batch, max_images, C, H, W)``: sample b's images sit in its first slots and
the rest are padding (any values, never read). Which slots are real needs no extra tensor: a sample
with k images holds ``k * config.tokens_per_image`` image tokens in ``input_ids``, and that count is
what ``image_counts`` reads (a count that is not a multiple, or more images than slots, is refused).
A micro-batch of rows is therefore self-describing. The flat 4-D layout is accepted too (one process,
transformers' convention: the images in sample order, as many as the image tokens ask for). The counts
are read on the host (one device sync per micro-batch on the first stage), so the tower runs on the real
images only.

Labels: ``next_token_labels`` shifts a token batch and masks (``-100``) targets that are image tokens
or padding, so the loss and ``layers.step_normalizer`` count only text targets. Padding goes on the
right (the decoder is causal, so real tokens never see it).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def image_counts(input_ids: torch.Tensor, image_token_id: int, tokens_per_image: int) -> torch.Tensor:
    """Images per sample (batch,), read from the image tokens in ``input_ids`` (batch, seq)."""
    per_sample = (input_ids == image_token_id).sum(dim=1)
    if bool((per_sample % tokens_per_image).any()):
        bad = [int(n) for n in per_sample]
        raise ValueError(f"image tokens per sample {bad} are not multiples of the {tokens_per_image} tokens one "
                         "image fills")
    return per_sample // tokens_per_image


def real_images(pixel_values: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                tokens_per_image: int) -> torch.Tensor:
    """The images the image tokens stand for, in sequence order, as (n, C, H, W).

    5-D ``(batch, max_images, C, H, W)``: each sample's first ``image_counts`` slots; 4-D: transformers'
    flat layout, all of it (the count must match the image tokens)."""
    counts = image_counts(input_ids, image_token_id, tokens_per_image)
    if pixel_values.dim() == 4:
        if pixel_values.size(0) != int(counts.sum()):
            raise ValueError(f"{pixel_values.size(0)} images given for {int(counts.sum())} images' worth of image "
                             "tokens")
        return pixel_values
    if pixel_values.dim() != 5 or pixel_values.size(0) != input_ids.size(0):
        raise ValueError(f"pixel_values must be (batch={input_ids.size(0)}, max_images, C, H, W) or "
                         f"(images, C, H, W), got {tuple(pixel_values.shape)}")
    if counts.numel() and int(counts.max()) > pixel_values.size(1):
        raise ValueError(f"a sample holds {int(counts.max())} images' worth of image tokens but pixel_values has "
                         f"{pixel_values.size(1)} slots per sample")
    slots = torch.arange(pixel_values.size(1), device=counts.device)[None, :] < counts[:, None]
    return pixel_values[slots.to(pixel_values.device)]


def merge_features(embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                   features: torch.Tensor) -> torch.Tensor:
    """``embeds`` with the image-token positions replaced, in order, by the rows of ``features``
    (images, tokens_per_image, hidden); differentiable in both."""
    mask = (input_ids == image_token_id).unsqueeze(-1)
    return embeds.masked_scatter(mask, features.to(embeds.dtype))


def next_token_labels(tokens: torch.Tensor, image_token_id: int, pad_token_id: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of a token batch (batch, seq + 1): ``labels[:, i]`` is token i + 1, ``-100`` where
    that target is an image token or padding."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    masked = labels == image_token_id
    if pad_token_id is not None:
        masked |= labels == pad_token_id
    return inputs, labels.masked_fill(masked, IGNORE_INDEX)
