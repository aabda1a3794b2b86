"""Fine-tuning steps for a pipeline: ``FinetuneData(documents, token_budget, num_chunks).step(i)``.

A step is ``num_chunks`` micro-batches of at most ``token_budget`` tokens each (``batching.py``:
packed rows or length buckets), shapes differing between them, passed to ``Pipeline.step`` as
lists (ragged micro-batches). Which documents form which micro-batch is decided once; every epoch
takes the micro-batches in a new seeded order, and the micro-batches that do not fill a whole step
at an epoch's end wait for a later epoch (another order leaves out others). Steps are addressed
by index, so a loop that rewinds (``resilience.Rewind``) or resumes gets the same step for the
same index; tensors are built only for the step asked for.

With ``replicas`` data-parallel replicas (``dp_batch="local"``: each passes its own micro-batches)
a step holds ``num_chunks * replicas`` micro-batches, replica r taking its ``num_chunks``. The
step's ``valid_tokens`` counts the targets of all of them, the same number on every replica with
no collective (every replica plans the same documents), and ``normalizer`` is that count over the
replicas: what ``lm_loss(..., normalizer=)`` divides the summed token losses by, so that the
replicas' averaged gradients are those of the step's token mean (``layers.step_normalizer``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batching import MicroBatch, assign_microbatches, microbatch
from .documents import Document


@dataclass(frozen=True)
class FinetuneStep:
    """One replica's micro-batches of a step and the step's valid-target count over every replica."""

    microbatches: tuple[MicroBatch, ...]
    valid_tokens: int  # labels that are not -100, in every replica's micro-batches of the step
    replicas: int = 1

    def __len__(self) -> int:
        return len(self.microbatches)

    @property
    def input_ids(self) -> list[torch.Tensor]:
        return [mb.input_ids for mb in self.microbatches]

    @property
    def labels(self) -> list[torch.Tensor]:
        return [mb.labels for mb in self.microbatches]

    @property
    def position_ids(self) -> list[torch.Tensor]:
        return [mb.position_ids for mb in self.microbatches]

    @property
    def normalizer(self) -> float:
        """``valid_tokens / replicas``: the criterion's ``normalizer`` for this step."""
        return self.valid_tokens / self.replicas


class FinetuneData:
    """Steps of ``num_chunks`` token-budget micro-batches (per replica) over ``documents``, by index.

    ``mode``, ``seq_len``: as in ``batching.token_budget_batches``; ``pad_id`` fills padded inputs.
    """

    def __init__(self, documents: Sequence[Document], token_budget: int, num_chunks: int, *, mode: str = "pack",
                 seq_len: int | None = None, replicas: int = 1, seed: int = 0, pad_id: int = 0) -> None:
        if num_chunks < 1 or replicas < 1:
            raise ValueError(f"num_chunks and replicas must be >= 1, got num_chunks={num_chunks}, replicas={replicas}")
        self.documents = list(documents)
        self.num_chunks, self.replicas, self.seed, self.pad_id = num_chunks, replicas, seed, pad_id
        self.groups = assign_microbatches(self.documents, token_budget, mode=mode, seq_len=seq_len, seed=seed)
        self.group_targets = [sum(self.documents[d].num_targets for row in g for d in row) for g in self.groups]
        self.per_step = num_chunks * replicas
        self.steps_per_epoch = len(self.groups) // self.per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"the documents make {len(self.groups)} micro-batches of at most {token_budget} tokens, "
                             f"fewer than one step's num_chunks * replicas = {self.per_step}; add documents or lower "
                             "token_budget")
        self._epoch: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        """The micro-batches in epoch ``epoch``'s order (the last epoch's is kept)."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(len(self.groups)))
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def step(self, index: int, replica: int = 0) -> FinetuneStep:
        """Replica ``replica``'s micro-batches of step ``index`` (the same ones for the same index)."""
        if index < 0:
            raise ValueError(f"step index must be >= 0, got {index}")
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in 0..{self.replicas - 1}, got {replica}")
        epoch, k = divmod(index, self.steps_per_epoch)
        ids = self._order(epoch)[k * self.per_step: (k + 1) * self.per_step]
        mine = ids[replica * self.num_chunks: (replica + 1) * self.num_chunks]
        return FinetuneStep(tuple(microbatch(self.documents, self.groups[g], self.pad_id) for g in mine),
                            sum(self.group_targets[g] for g in ids), self.replicas)
