"""Activation recompute policies applied to pipeline stages when they are built.

``"none"`` keeps every activation autograd saves. ``"selective"`` recomputes the cheap, memory-heavy
pieces in backward. For DeepSeek-V3 that is MLA from its latents (``MLA.attend``: the q/kv latents'
RMSNorms, the up-projections ``q_b_proj`` / ``kv_b_proj``, RoPE and the core attention), the production
choice of the report (§3.2.3): per layer, the attention keeps its input and ``input_layernorm``'s
statistics, the normed input (the down-projections' input, needed for their weight gradients), the
two latents (``q_a_proj``'s output and ``kv_a_proj_with_mqa``'s kv latent + rotary key) and the core's
output (``o_proj``'s input) — not q, k, v (n_heads x (2 qk_head_dim + v_head_dim) per token) nor the probabilities; the
FFN / MoE keeps what it keeps under ``"none"``. For the families on the shared layer (Llama, Qwen3-MoE)
it recomputes the core attention (``layers.attention.GQAttention.core``: QKᵀ, softmax, ·V — its S×S
probabilities dominate) and each SwiGLU product (``layers.mlp.SwiGLUMLP.act``), as Megatron's selective
recompute does; those modules declare it themselves. ``"full"`` keeps only each layer's input:
the whole layer is recomputed (DeepSeek-V3 MoE layers: the attention sublayer and every expert and
shared expert; the router and the dispatch/combine all-to-alls are never re-run, since they count
loads and talk to other ranks).

Each region runs under ``torch.utils.checkpoint(use_reentrant=False)``: the forward stores only the
region's inputs, and the first backward node that unpacks a saved tensor of the region recomputes
it — once, inside B. With the zero-bubble split the ``DeferredLinear`` / ``FP8Linear`` backward of
B unpacks its input there and hands it to the queued weight-gradient closure, so W reuses the
tensor B recomputed and never recomputes (those tensors then live from B until W; while the
runtime records activation bytes, ``runtime.activation_bytes``, the recompute reports them to it
so they are counted until W frees them). The policy is applied by replacing the bound method on the
instance: parameter names, state dicts and the single-process reference stay unchanged, and every
call path (plain forward, the tape of the overlapped F&B) goes through it. ``recompute_calls``
counts how often each region ran (forward + recompute), which is how the tests check "once in B,
never in W".
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.checkpoint import checkpoint

from ..runtime.activation_bytes import ActivationBytes

POLICIES = ("none", "selective", "full")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {POLICIES}")
    return policy


def recompute_method(module: nn.Module, name: str, counts: Counter | None = None, tag: str | None = None) -> None:
    """Make ``module.<name>`` a recomputed region (checkpointed; ``counts[tag]`` += 1 per run)."""
    original = getattr(module, name)
    key = tag or f"{type(module).__name__}.{name}"

    def counted(*args: Any) -> Any:
        if counts is not None:
            counts[key] += 1
        return original(*args)

    def region(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args)  # inference: nothing is saved, nothing to recompute
        return checkpoint(counted, *args, use_reentrant=False, context_fn=_contexts)

    setattr(module, name, region)


def _contexts() -> tuple[Any, Any]:
    """(forward, recompute) contexts of a region: the recompute reports the tensors W will keep."""
    return nullcontext(), _KeptForW()


class _KeptForW:
    """While a region recomputes in B with the runtime recording activation bytes: the inputs of the
    layers that defer their weight gradient to W (``supports_deferred_weight_grad``) are what the
    queued W keeps from the recompute, so they are handed to the recorder, which counts each storage
    until it is freed (at W, or at once when B computed the weight gradient itself)."""

    def __enter__(self) -> None:
        recorder = ActivationBytes.active()
        self.handle = None if recorder is None else register_module_forward_pre_hook(
            lambda module, args: _track_inputs(recorder, module, args))

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


def _track_inputs(recorder: ActivationBytes, module: nn.Module, args: tuple) -> None:
    if getattr(type(module), "supports_deferred_weight_grad", False):
        for a in args:
            if isinstance(a, torch.Tensor):
                recorder.recomputed(a)


@runtime_checkable
class DeclaresRecompute(Protocol):
    """A layer that names its own recompute regions: ``(module, method name, tag)`` per policy.

    Each model family's layer class implements it (DeepSeek-V3's ``Block``, the shared layer's
    ``GQAttention`` and ``SwiGLUMLP``, each family's decoder layer for ``"full"``), so this module knows no
    family and a new family needs no case here.
    """

    def recompute_regions(self, policy: str) -> Iterable[tuple[nn.Module, str, str]]:
        ...


def stage_policy(stage: nn.Module, policy: str) -> str:
    """``policy`` for a family's stage, or ``"none"`` for one with no layer that declares regions (the embedding
    alone, at a depth the model barely fills): nothing there to rebuild."""
    return policy if any(isinstance(m, DeclaresRecompute) for m in stage.modules()) else "none"


def apply_recompute(stage: nn.Module, policy: str) -> Counter:
    """Apply ``policy`` in place to every layer of ``stage`` (a stage or a whole model) that declares its
    regions (``DeclaresRecompute``); returns the counter of region runs, also kept as ``stage.recompute_calls``."""
    check_policy(policy)
    counts: Counter = Counter()
    stage.recompute_policy = policy
    stage.recompute_calls = counts
    if policy == "none":
        return counts
    declaring = [m for m in stage.modules() if isinstance(m, DeclaresRecompute)]
    # layers that declare regions but have none for this policy are no mistake: the "attention" and "swiglu"
    # savers already rebuild in B what "selective" would, so under both it has nothing left to recompute
    targets = [t for m in declaring for t in m.recompute_regions(policy)]
    if not declaring:
        raise ValueError(f"recompute policy {policy!r}: {type(stage).__name__} has no layer that declares recompute "
                         "regions (recompute_regions(policy), as DeepSeek-V3's Block and Llama's decoder layer do)")
    for module, name, tag in targets:
        recompute_method(module, name, counts, tag)
    return counts


class SavedActivationMeter:
    """Live and peak bytes of the tensors autograd saves for backward while active (this thread).

    Storages are counted once however many saved tensors view them, from the moment a forward saves
    them until the graph releases the last saved view. Tensors saved inside a recompute region are not
    saved (the region keeps only its inputs), which is exactly the saving the policies buy; tensors a
    region recomputes in B are transient and are not counted (the ones a deferred W keeps live until W).
    ``exclude``: tensors (e.g. the model's parameters) whose storages are not activations and are
    not counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded:
            return t
        if key not in self._refs:
            self._refs[key] = 0
            self._bytes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def _unpack(box: Any) -> torch.Tensor:
        return box if isinstance(box, torch.Tensor) else box.tensor

    @contextmanager
    def measure(self) -> Iterator[SavedActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Box:
    """What the graph holds for one saved tensor; its collection marks the tensor released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

