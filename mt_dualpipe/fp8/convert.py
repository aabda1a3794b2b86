"""convert_to_fp8: swap a model's linears for FP8 ones, keeping DeepSeek-V3's high-precision parts.

DeepSeek-V3 (§3.3.1) keeps the embedding, the output head, the MoE gating, the normalisations and
the attention core (scores, softmax, weighted sum) in BF16/FP32 because they are cheap and
sensitive. Embeddings, norms and the attention core are not ``nn.Linear`` and are never touched;
the head and the gate *are* linears, so they are skipped by name: a linear is kept when any dotted
component of its qualified name is in ``DEFAULT_SKIP`` (``head``, ``lm_head``, ``output``,
``gate``, ``router``, ...). ``gate_proj`` (a SwiGLU FFN projection) is converted: only whole
components match. Only exact ``nn.Linear`` and ``DeferredLinear`` instances are converted (the latter
becomes an FP8Linear, which defers its weight gradient too); other subclasses may carry a different
forward (e.g. ``nn.MultiheadAttention.out_proj``) and are left alone.

Engines: ``backend="auto" | "scaled_mm" | "emulated"`` use this package's FP8Linear (which supports
the zero-bubble B/W split); ``"torchao"`` hands the same selection to torchao's
``convert_to_float8_training`` (row-wise recipe, its closest to DeepSeek's tiles) and
``"transformer_engine"`` swaps in ``te.Linear`` run under TE's ``Float8BlockScaling`` recipe (the
DeepSeek-style 1×128 / 128×128 scaling). Both are optional, detected, never required; their
modules do not defer weight gradients, so a zero-bubble runtime runs their W inside B.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
from torch import nn

from ..runtime.deferred import DeferredLinear
from .backends import BACKENDS, backend_summary, has_module
from .linear import FP8Linear

log = logging.getLogger(__name__)

DEFAULT_SKIP: tuple[str, ...] = (
    "head", "lm_head", "output", "output_head", "out_head", "gate", "router", "embed", "embedding",
    "tok_embeddings", "embed_tokens", "wte",
)
ENGINES = ("torchao", "transformer_engine")
CONVERTIBLE: tuple[type[nn.Linear], ...] = (nn.Linear, DeferredLinear)  # exact types only

Skip = Union[Iterable[str], Callable[[str, nn.Module], bool], None]


def skip_predicate(skip: Skip = DEFAULT_SKIP) -> Callable[[str, nn.Module], bool]:
    """``skip`` as a predicate on (qualified name, module).

    An iterable of patterns matches when any pattern equals (``fnmatch``) a dotted component of the
    name, or the whole name; a callable is used as is; ``None`` skips nothing.
    """
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        raise TypeError("skip must be an iterable of name patterns (e.g. ('head', 'gate')), a callable or None, "
                        f"not the string {skip!r}")
    patterns = tuple(skip)

    def predicate(name: str, module: nn.Module) -> bool:
        parts = name.split(".") + [name]
        return any(fnmatch.fnmatchcase(part, p) for p in patterns for part in parts)

    return predicate


def _candidates(model: nn.Module, skip: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if type(m) in CONVERTIBLE and not skip(name, m)]


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def convert_to_fp8(model: nn.Module, skip: Skip = DEFAULT_SKIP, backend: str = "auto",
                   verbose: bool = False) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` modules (except those ``skip`` names) with FP8 layers, in place.

    The converted layers share the original parameter objects, so state dicts, parameter names and
    optimizers built earlier are unchanged. Returns ``model``. With ``verbose`` prints one line naming
    the active backend and how many linears were converted / kept.
    """
    if backend not in BACKENDS + ENGINES:
        raise ValueError(f"unknown FP8 backend {backend!r}; choose one of {', '.join(BACKENDS + ENGINES)}")
    if type(model) in CONVERTIBLE:
        raise TypeError("convert_to_fp8 converts the linears inside a model in place; "
                        "wrap a bare nn.Linear with FP8Linear.from_linear(linear) instead")
    pred = skip_predicate(skip)
    targets = _candidates(model, pred)
    kept = sum(1 for _, m in model.named_modules() if type(m) in CONVERTIBLE) - len(targets)
    if backend == "torchao":
        _convert_torchao(model, pred)
        line = f"fp8 backend: torchao Float8Linear (row-wise recipe); {len(targets)} linears converted, {kept} kept"
    elif backend == "transformer_engine":
        for name, m in targets:
            _set(model, name, TransformerEngineLinear.from_linear(m))
        line = (f"fp8 backend: transformer_engine Linear (Float8BlockScaling); {len(targets)} linears converted, "
                f"{kept} kept")
    else:
        for name, m in targets:
            _set(model, name, FP8Linear.from_linear(m, backend=backend))
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        line = f"{backend_summary(device, backend)}; {len(targets)} linears converted, {kept} kept"
    log.info(line)
    if verbose:
        print(line)
    return model


def _require(module: str, backend: str) -> None:
    if not has_module(module):
        raise RuntimeError(f"FP8 backend {backend!r} needs the optional package {module!r}, which is not installed; "
                           "use backend='auto' (this package's FP8Linear) instead")


def _convert_torchao(model: nn.Module, skip: Callable[[str, nn.Module], bool]) -> None:
    _require("torchao", "torchao")
    # lazy: torchao is an optional FP8 backend, imported only when it is asked for
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: type(m) in CONVERTIBLE and not skip(fqn, m),
                               config=config)


class TransformerEngineLinear(nn.Module):
    """``te.Linear`` run under TE's ``Float8BlockScaling`` recipe (DeepSeek-style blocks).

    The parameters live in the TE module, so their names gain an ``inner.`` prefix
    (``inner.weight``, ``inner.bias``, plus TE's ``inner._extra_state``); load a plain checkpoint
    before converting.
    """

    def __init__(self, inner: nn.Module, recipe: Any) -> None:
        super().__init__()
        self.inner = inner
        self._recipe = recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransformerEngineLinear:
        _require("transformer_engine", "transformer_engine")
        # lazy: transformer_engine is an optional FP8 backend, imported only when it is asked for
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8BlockScaling

        if linear.weight.device.type != "cuda":
            raise RuntimeError("FP8 backend 'transformer_engine' runs on CUDA only; "
                               f"this linear is on {linear.weight.device}")
        inner = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          params_dtype=linear.weight.dtype)
        with torch.no_grad():
            inner.weight.copy_(linear.weight)
            if linear.bias is not None:
                inner.bias.copy_(linear.bias)
        return cls(inner, Float8BlockScaling())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te  # lazy: optional FP8 backend (from_linear imported it)

        with te.fp8_autocast(enabled=True, fp8_recipe=self._recipe):
            return self.inner(x)
