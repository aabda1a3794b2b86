"""transformers as a float64 reference for the model families (a test extra, never a runtime need).

transformers pins RMSNorm, RoPE, the attention softmax and the MoE router to float32 whatever the
model dtype (``hidden_states.to(torch.float32)``, ``dtype=torch.float``, ...), so a float64
transformers model agrees with a float64 one only to ~1e-7. ``float64_transformers`` lifts that pin
for the duration of a test by giving the named transformers modules a ``torch`` whose ``float32`` and
``float`` are ``float64``; both sides then compute in float64 and must agree to ~1e-15.
``recorded_reads`` lists the tensors a per-stage checkpoint load reads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

MODULES = ("transformers.modeling_rope_utils", "transformers.models.deepseek_v3.modeling_deepseek_v3",
           "transformers.models.llama.modeling_llama")


class _Float64Torch:
    """``torch`` with ``float32`` / ``float`` meaning ``float64``."""

    def __getattr__(self, name: str):
        if name in ("float32", "float"):
            return torch.float64
        return getattr(torch, name)


@contextmanager
def float64_transformers() -> Iterator[None]:
    mods = [importlib.import_module(m) for m in MODULES]
    saved = [m.torch for m in mods]
    try:
        for m in mods:
            m.torch = _Float64Torch()
        yield
    finally:
        for m, t in zip(mods, saved):
            m.torch = t


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Every parameter and float buffer random (norm weights around 1), so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) * std
        t.copy_(noise + 1 if "norm" in name else noise)


@contextmanager
def recorded_reads() -> Iterator[list[str]]:
    """The tensor names every ``hf_checkpoint.Checkpoint.read`` yields inside the block, in order (the list stays
    filled after it): what a per-stage load really read from the files."""
    from mt_dualpipe.models import hf_checkpoint

    read: list[str] = []
    real = hf_checkpoint.Checkpoint.read

    def recording(self, names):
        for name, t in real(self, names):
            read.append(name)
            yield name, t

    hf_checkpoint.Checkpoint.read = recording
    try:
        yield read
    finally:
        hf_checkpoint.Checkpoint.read = real


def unfused_grads(model: torch.nn.Module, rename: Callable[[str], str | None] = lambda name: name
                  ) -> dict[str, torch.Tensor]:
    """``model``'s parameter gradients (None: zeros) by ``rename(checkpoint name)``. transformers 5 keeps a MoE
    layer's experts fused, ``experts.gate_up_proj`` (experts, 2 * inter, hidden: gate rows, then up rows) and
    ``experts.down_proj`` (experts, hidden, inter), where checkpoints and our models hold one
    ``experts.{e}.gate_proj / up_proj / down_proj.weight`` per expert: they are split that way here."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".experts") and last == "gate_up_proj":
            parts = {f"{prefix}.{e}.{kind}.weight": half for e, g in enumerate(grad)
                     for kind, half in zip(("gate_proj", "up_proj"), g.chunk(2, dim=0))}
        elif prefix.endswith(".experts") and last == "down_proj":
            parts = {f"{prefix}.{e}.down_proj.weight": g for e, g in enumerate(grad)}
        else:
            parts = {name: grad}
        for key, g in parts.items():
            ours = rename(key)
            if ours is not None:
                out[ours] = g
    return out
