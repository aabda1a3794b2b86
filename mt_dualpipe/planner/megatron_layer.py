"""Megatron-LM's GPT decoder layer, as published runs built on Megatron-LM ran it: what it keeps for the
backward and what its unfused core attention moves, so the planner can be asked about those runs.

The planner's own account of a layer (``planner/activations.py``) follows this library's modules. A
published run used another implementation, whose kernels keep other tensors: Megatron-LM's "local"
GPT layer fuses its LayerNorm (keeping its input and two per-row statistics), its bias-GeLU and its
scale-mask-softmax (in the half-precision dtype), and applies dropout after the attention probabilities
and after each sublayer.
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, section 4.1) count it tensor by tensor, per token of a layer with sequence ``s``,
hidden ``h``, ``a`` heads, 16-bit activations and 1-byte dropout masks:

- attention: the LayerNorm's input ``2h``, the QKV projection's input ``2h``, q and k ``4h``, v ``2h``,
  the softmax output ``2as``, the attention-dropout mask ``as`` and its output ``2as``, the output
  projection's input ``2h``, the dropout mask after it ``h``: ``11h + 5as`` (+ ``2h`` LayerNorm);
- MLP: the LayerNorm's input ``2h``, the first linear's input ``2h``, the GeLU's input and output
  ``2 ffn`` each, the dropout mask ``h``: ``19h`` at ``ffn = 4h``;
- ``34h + 5as`` in all (the LayerNorms' per-row statistics, 8 bytes a token each, are left out, as the paper
  leaves them); "selective" recompute (re-running the core attention) keeps ``34h``, "full" the
  layer's input ``2h`` (the paper's sections 4.1-4.2).

Its core is unfused (``Strategy.attention = "eager"``): the full S×S scores go through one fused
scale-mask-softmax kernel (read and write 2 bytes per element) and the attention dropout (read 2, write
2 and the 1-byte mask): ``SCORE_BYTES`` per element in F.

Used by ``calibration.run_model`` for a model whose description says ``"implementation": "megatron-lm"``
(the Zero Bubble paper's runs, Megatron-LM's GPT-3 175B example); the runtime builds no such layer, so a
plan never offers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..schedules.errors import ScheduleError
from .model import ModelSpec

SCORE_BYTES = 4.0 + 5.0
"""Bytes per S×S score element in F: the fused scale-mask-softmax (read 2, write 2), the attention dropout
(read 2, write 2, the 1-byte mask)."""
ELEM = 2.0  # 16-bit activations (the runs' fp16)


def saved_bytes_per_token(spec: ModelSpec, recompute: str, seq: int) -> float:
    """Korthikanti et al. 2022's count (module doc) of one GPT layer's saved bytes per token."""
    h, a, ffn = spec.hidden_size, spec.head_num, spec.intermediate_size
    if recompute == "full":
        return 2 * h
    attention = 2 * h + 2 * h + 4 * h + 2 * h + 2 * h + h  # LayerNorm in, QKV in, q k, v, projection in, mask
    mlp = 2 * h + 2 * h + 2 * ffn + 2 * ffn + h  # LayerNorm in, first linear in, GeLU in and out, mask
    scores = 5 * a * seq if recompute == "none" else 0  # softmax out, dropout mask, dropout out
    return attention + mlp + scores


def megatron_gpt(spec: ModelSpec) -> ModelSpec:
    """``spec`` described as Megatron-LM's GPT layer: its saved bytes (``declared_saved``, in 16-bit elements)
    and its core's score traffic (``score_bytes``)."""
    if spec.is_moe or spec.use_swiglu or spec.attention_type == "mla":
        raise ScheduleError(f"{spec.name}: the megatron-lm implementation describes a GPT layer (GeLU MLP, "
                            "multi-head attention, no experts); set use_swiglu false and drop the MoE/MLA keys")

    def declared(kind: str, recompute: str, seq: int, t: object = None) -> float:
        return saved_bytes_per_token(spec, recompute, seq) / ELEM

    return replace(spec, declared_saved=declared, score_bytes=SCORE_BYTES)


ACCOUNTS: dict[str, Callable[[ModelSpec], ModelSpec]] = {"mt_dualpipe": lambda spec: spec, "megatron-lm": megatron_gpt}
"""Whose layer a model description means -> how the planner describes it: this library's modules (the default,
``planner/activations.py``) or Megatron-LM's GPT layer."""
IMPLEMENTATIONS = tuple(ACCOUNTS)


def with_implementation(spec: ModelSpec, implementation: str) -> ModelSpec:
    """``spec`` as ``implementation`` (``IMPLEMENTATIONS``) builds its layers."""
    if implementation not in ACCOUNTS:
        raise ScheduleError(f"unknown implementation {implementation!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    return ACCOUNTS[implementation](spec)
