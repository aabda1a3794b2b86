"""Per-stage state of one rank: what F keeps for B, what B keeps for W, and the ops themselves.

A ``Stage`` wraps one stage module of one chain. Per micro-batch it holds the inputs (autograd
leaves, so B can return their gradients), the outputs (the roots of B) or the loss of a chain's
last stage, the input gradients until they are sent, and what W still has to do. Everything of a
micro-batch is dropped at its W (or BW), which is what frees its activations.

Split backward has two paths (see ``backward.py`` and ``weight_grad.py``): the fast path when the
stage's parameter owners all defer their weight gradients or are cheap to differentiate (see
``supports_fast_split``: B runs with the pipeline's ``WeightGradStore`` active, W runs the queued
closures), the generic path otherwise. The generic B also runs with the store active, so layers
that defer (``DeferredLinear``) still leave their GEMMs to W when the generic split has to fall back
to a full backward.

An exception inside a stage's forward, criterion or backward comes back as a ``PipelineError``
naming the rank, the op, the stage and the micro-batch (the original chained as its cause).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from . import checkpoint_reuse, compiled
from .backward import backward_roots, full_backward, has_reentrant_checkpoint, split_backward
from .errors import PipelineError
from .weight_grad import WeightGradStore, fused_forward, held_post_accumulate_hooks


def _as_outputs(out: Any, stage: Stage, mb: int) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors, or a clear error (the message is built only then)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out) and len(out) > 0:
        return tuple(out)
    kinds = type(out).__name__ if not isinstance(out, (tuple, list)) else \
        f"{type(out).__name__} of {', '.join(type(t).__name__ for t in out) or 'nothing'}"
    raise PipelineError(f"{stage.name}, micro-batch {mb}, returned a {kinds}; a stage must return a Tensor or a "
                        "non-empty tuple/list of Tensors (they are what is sent to the next stage)")


_NOTHING = contextlib.nullcontext()
_STORE_ONLY = ("store", None)  # pending W: only the store's group (the fast split, or nothing left by the generic one)

CHEAP_PARAMETER_OWNERS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.Embedding)


def _defers(m: nn.Module) -> bool:
    return bool(getattr(type(m), "supports_deferred_weight_grad", False))


def _cheap(m: nn.Module) -> bool:
    return isinstance(m, CHEAP_PARAMETER_OWNERS) or bool(getattr(type(m), "cheap_weight_grad", False))


def supports_fast_split(module: nn.Module) -> bool:
    """Whether a B of ``module`` can run as one full backward with the ``WeightGradStore`` active.

    True when every module owning parameters either declares ``supports_deferred_weight_grad`` (its
    weight-gradient GEMM is queued for W) or is cheap to differentiate: norms (``nn.LayerNorm``,
    ``nn.RMSNorm``), ``nn.Embedding`` and any class declaring ``cheap_weight_grad = True``. The
    cheap owners' weight gradients are simply computed during B, so W then runs only the deferred
    GEMMs. At least one owner must defer, else nothing would be left for W and the generic split
    (which can defer the cheap gradients too) is the better path. An expensive owner that declares
    neither forces the generic path.
    """
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return any(_defers(m) for m in owners) and all(_defers(m) or _cheap(m) for m in owners)


def deferred_params(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """Trainable parameters of owners that defer their weight gradients to W (``supports_deferred_weight_grad``).

    In a B with the store active their layers return no weight gradient, and autograd would still
    run their accumulation with nothing in it — calling post-accumulate-grad hooks with a None
    ``.grad``. The stage holds those hooks back for the B (``held_post_accumulate_hooks``); they
    fire at W, when the store accumulates the gradient through autograd (``put_grads``).
    """
    seen: set[int] = set()
    out = []
    for m in module.modules():
        if _defers(m):
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return tuple(out)


def _swaps_params(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule  # lazy: FSDP loads ~0.8 s; the runtime imports without it

    return any(isinstance(m, FSDPModule) for m in module.modules())


_LOST_GRADIENTS = "None of the inputs have requires_grad=True. Gradients will be None"
"""torch.utils.checkpoint's warning when a reentrant region's inputs need no gradient: its parameters get none."""


@contextlib.contextmanager
def _refusing_lost_gradients(where: str, shown: set) -> Any:
    """Turn torch's "gradients will be None" warning of a reentrant checkpoint into an error; pass others on.

    A reentrant checkpoint (``use_reentrant=True``) whose inputs do not require grad (a first
    stage's batch, say) makes an output that does not either, so the region's parameters silently
    get no gradient. torch only warns; a training step must not go on with them missing.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if str(w.message).startswith(_LOST_GRADIENTS):
            raise PipelineError(f"{where}: torch.utils.checkpoint(use_reentrant=True) got inputs none of which "
                                "requires grad, so the parameters inside it would get no gradient (torch's reentrant "
                                "checkpoint); use torch.utils.checkpoint(..., use_reentrant=False) or "
                                "checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT)")
    for w in caught:  # each once per place (``shown``), as Python's default filter would have shown them
        key = (str(w.message), w.category, w.filename, w.lineno)
        if key not in shown:
            shown.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


class Stage:
    """One (chain, stage) of this rank: its module and the per-micro-batch state of a step.

    ``rank`` (the pipeline rank, set by the ``Pipeline``) only names the rank in error messages.
    ``splits``: the schedule gives this stage W ops (split B); only then do its compiled regions need
    their plain linears split out of the graph (``compiled.split_products``), which a fused BW does not;
    other products (``FP8Linear``) run outside the graphs either way.
    ``fused``: the micro-batches whose backward the schedule runs fused (BW), set by the executor; their
    F runs under ``weight_grad.fused_forward`` when the module has deferring layers, so those build the
    plain autograd node (no Python ``autograd.Function`` to pay for a split that never comes).
    """

    def __init__(self, module: nn.Module, chain: int, stage: int, is_first: bool, is_last: bool,
                 store: WeightGradStore, rank: int | None = None, rank_name: str | None = None,
                 splits: bool = True):
        self.module, self.chain, self.stage = module, chain, stage
        self.rank_name = rank_name if rank_name is not None else (None if rank is None else f"rank {rank}")
        self._deferred = deferred_params(module)
        self._swaps_params = _swaps_params(module)
        self.is_first, self.is_last = is_first, is_last
        self.store = store
        self.rank = rank
        self.fast = supports_fast_split(module)
        self.reentrant: bool | None = None  # uses reentrant checkpointing; known at the first split B
        self.compiled = bool(compiled.compiled_regions(module))  # see compiled.py
        if self.compiled:
            compiled.split_products(module, linears=splits)
        self.checkpointed = False  # its forward ran non-reentrant checkpoint regions (B and W share their recompute)
        self._warned: set = set()  # warnings the module's forward raised, shown once each
        self._said_in_b: set[tuple[str, ...]] = set()  # the parameter sets a warning named as computed in B
        self.name = f"stage (chain {chain}, stage {stage}) {type(module).__name__}"
        self._defers = any(_defers(m) for m in module.modules())
        self.fused: frozenset[int] = frozenset()
        self.reset()

    def reset(self) -> None:
        self.inputs: dict[int, Sequence[torch.Tensor]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, list[torch.Tensor | None]] = {}
        self.pending_w: dict[int, Any] = {}
        self.free_after_send: dict[int, list[torch.Tensor]] = {}

    def where(self, op: str, mb: int) -> str:
        """``rank r F(chain c, stage s, mb m) in Module``: how errors name an op of this stage."""
        rank = "" if self.rank_name is None else f"{self.rank_name} "
        return f"{rank}{op}(chain {self.chain}, stage {self.stage}, mb {mb}) in {type(self.module).__name__}"

    def _error(self, op: str, mb: int, exc: Exception) -> PipelineError:
        """An exception of the user's code, re-raised with the rank, op, stage and micro-batch.

        Each op catches with a plain try/except (a context manager per op costs more than the
        smallest ops' bookkeeping); a ``PipelineError`` is re-raised as it is, it already says where.
        """
        return PipelineError(f"{self.where(op, mb)}: {type(exc).__name__}: {exc}")

    # ----- F ----------------------------------------------------------------------------------
    def forward(self, mb: int, inputs: Sequence[torch.Tensor], criterion: Callable | None,
                labels: Sequence[Any], training: bool, keep_outputs: bool) -> tuple[torch.Tensor, ...]:
        try:
            if training and torch.is_grad_enabled():
                with _refusing_lost_gradients(self.where("F", mb), self._warned), checkpoint_reuse.recording() as rec, \
                        self._no_donation(), fused_forward() if self._defers and mb in self.fused else _NOTHING:
                    out = self.module(*inputs)
                if rec.holders:
                    self.checkpointed = True
            else:
                out = self.module(*inputs)
        except PipelineError:
            raise
        except Exception as exc:
            raise self._error("F", mb, exc) from exc
        outs = _as_outputs(out, self, mb)
        self._keep(mb, inputs, outs, None, criterion, labels, training, keep_outputs)
        return outs

    def finish_forward(self, mb: int, inputs: Sequence[torch.Tensor], outs: Any, loss: torch.Tensor | None,
                       criterion: Callable | None, labels: Sequence[Any], training: bool,
                       keep_outputs: bool) -> None:
        """Keep what B needs (inputs, outputs or loss) after the F of ``mb`` produced ``outs``."""
        self._keep(mb, inputs, _as_outputs(outs, self, mb), loss, criterion, labels, training, keep_outputs)

    def _keep(self, mb: int, inputs: Sequence[torch.Tensor], outs: tuple[torch.Tensor, ...],
              loss: torch.Tensor | None, criterion: Callable | None, labels: Sequence[Any], training: bool,
              keep_outputs: bool) -> None:
        """``finish_forward`` once ``outs`` is known to be a tuple of tensors."""
        if training:
            self.inputs[mb] = inputs
        if not self.is_last:
            if any(type(o) is not torch.Tensor for o in outs):  # a subclass: no DTensor crosses a boundary
                from ..parallel.tensor_parallel import dtensor_output_problem  # lazy: DTensor, only on a subclass

                problem = dtensor_output_problem(outs)
                if problem:
                    raise PipelineError(f"{self.where('F', mb)}: {problem}")
            self.outputs[mb] = outs
            return
        if loss is None and criterion is not None:
            loss = self._loss(mb, criterion, outs, labels)
        if training and (loss is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1):
            self._refuse_loss(mb, loss)
        if loss is not None:
            self.losses[mb] = loss
        if keep_outputs:
            self.outputs[mb] = tuple(o.detach() for o in outs)

    def _refuse_loss(self, mb: int, loss: Any) -> None:
        """A training step needs one scalar loss per micro-batch, as ``loss.backward()`` does."""
        if loss is None:
            raise PipelineError(f"{self.name} ends a chain but no criterion was given: a training step needs "
                                "criterion on the ranks that hold a chain's last stage")
        is_tensor = isinstance(loss, torch.Tensor)
        what = f"a tensor of shape {tuple(loss.shape)}" if is_tensor else f"a {type(loss).__name__}"
        raise PipelineError(f"{self.where('F', mb)}: the criterion returned {what}; a training step needs a "
                            "scalar loss Tensor per micro-batch (PyTorch's backward() refuses a non-scalar "
                            "one too): reduce it, e.g. reduction='mean' or .sum()")

    def _loss(self, mb: int, criterion: Callable, outs: Sequence[torch.Tensor], labels: Sequence[Any]) -> Any:
        """``criterion(*outputs, *labels)``; a TypeError with no labels given means they are missing."""
        try:
            return criterion(*outs, *labels)
        except TypeError as exc:
            if labels and not all(v is None for v in labels):
                raise PipelineError(f"{self.where('F', mb)}, criterion: TypeError: {exc}") from exc
            rank = "this rank" if self.rank_name is None else self.rank_name
            raise PipelineError(
                f"{self.where('F', mb)}: the criterion was called without labels and raised TypeError: {exc}; "
                f"{rank} holds the last stage {self.stage} of chain {self.chain}, so pass labels= to step() here "
                "(they are split into micro-batches like the inputs)") from exc
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(f"{self.where('F', mb)}, criterion: {type(exc).__name__}: {exc}") from exc

    # ----- B / BW / W -------------------------------------------------------------------------
    def roots(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> tuple[list, list]:
        """The tensors B starts from: the loss of a last stage, else the outputs that got a grad."""
        if self.is_last:
            loss = self.losses[mb]
            return [loss], [torch.ones_like(loss)]
        return backward_roots(self.outputs[mb], grads)

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None] | None, split: bool) -> None:
        """B (``split``: weight gradients left for W) or BW; keeps the input grads for sending."""
        roots, gs = self.roots(mb, grads)
        inputs = self.inputs[mb]
        try:
            with self._no_donation():
                if not split:
                    input_grads = full_backward(roots, gs, inputs)
                elif self.fast or self.reentrant or (self.reentrant is None and self._reentrant(roots)):
                    with self._deferring(mb):
                        input_grads = full_backward(roots, gs, inputs)
                    self.pending_w[mb] = _STORE_ONLY
                else:  # store active too: deferring layers queue their GEMMs if the split falls back
                    why: list[tuple[str, tuple[torch.Tensor, ...]]] = []
                    shared = checkpoint_reuse.SharedRecompute() if self.checkpointed else None
                    with self._deferring(mb):
                        input_grads, w = split_backward(roots, gs, inputs, why, shared)
                    self.pending_w[mb] = _STORE_ONLY if w is None else ("store", w)
                    if why:
                        self._say_weights_in_b(*why[0])
        except PipelineError:
            raise
        except Exception as exc:
            raise self._error("B" if split else "BW", mb, exc) from exc
        self.after_backward(mb, input_grads, split)

    def _say_weights_in_b(self, reason: str, weights: Sequence[torch.Tensor]) -> None:
        """Warn, once per set of parameters, which of them get their gradients in B and why.

        Parameters of deferring layers are left out (their GEMMs are queued for W even when the generic split
        falls back), so queued W work neither hides the warning nor makes it name weights that did move."""
        deferred = {id(p) for p in self.deferred_now()}
        wanted = {id(w) for w in weights} - deferred
        names = tuple(n for n, p in self.module.named_parameters() if id(p) in wanted)
        if not names or names in self._said_in_b:
            return
        self._said_in_b.add(names)
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        warnings.warn(f"{self.name}: the weight gradients of {shown} are computed in B, not W: {reason}.",
                      stacklevel=3)

    @contextlib.contextmanager
    def _deferring(self, mb: int) -> Any:
        """A split B of ``mb``: the store collects the deferred GEMMs, their parameters' hooks wait for W."""
        with self.store.deferring((self.chain, self.stage, mb)), held_post_accumulate_hooks(self.deferred_now()):
            yield

    def deferred_now(self) -> tuple[torch.Tensor, ...]:
        """``deferred_params`` of the module as it is now: FSDP2 swaps in unsharded parameters for the step."""
        return deferred_params(self.module) if self._swaps_params else self._deferred

    def _reentrant(self, roots: list) -> bool:
        """Whether this stage uses reentrant checkpointing (checked at its first split B).

        Its B then runs one full backward (weight gradients included, deferring layers still
        deferred): torch cannot split a backward through a reentrant checkpoint.
        """
        if self.reentrant is None:
            self.reentrant = has_reentrant_checkpoint(roots)
            if self.reentrant:
                warnings.warn(f"{self.name} uses torch.utils.checkpoint(use_reentrant=True), whose backward cannot "
                              "be split: its B computes the weight gradients too (W has nothing left). Pass "
                              "use_reentrant=False to keep them for W.", stacklevel=2)
        return self.reentrant

    def after_backward(self, mb: int, input_grads: list, split: bool) -> None:
        if not self.is_first:
            for g in input_grads:  # (not ``None in``: that compares every tensor with None)
                if g is None:
                    input_grads = self._sendable(mb, input_grads)
                    break
            self.input_grads[mb] = input_grads
        if self.is_last:
            self.losses[mb] = self.losses[mb].detach()
        if not split:
            self._drop(mb)

    def _sendable(self, mb: int, input_grads: list) -> list:
        """Zeros for an input that takes a gradient but got none in this micro-batch.

        Whether an input gets a gradient can change from step to step (a stage returns
        ``(h, aux)`` and the criterion uses ``aux`` only sometimes); the message to the previous
        stage must keep one layout, so "no gradient" travels as zeros, which add nothing there.
        """
        for i, g in enumerate(input_grads):
            if g is None:
                x = self.inputs[mb][i]
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    input_grads[i] = torch.zeros_like(x)
        return input_grads

    def take_input_grads(self, mb: int) -> list[torch.Tensor | None]:
        """The input gradients of ``mb``'s B, handed to the previous stage on this rank (a V's turn)."""
        return self.input_grads.pop(mb)

    # ----- an overlapped F&B unit (the stage class's ``overlapped_forward_backward``) ----------------
    def overlapped_roots(self, mb: int, grads: Sequence[torch.Tensor | None] | None) -> tuple:
        """(loss, outputs, output grads) that ``overlapped_forward_backward`` starts the B of ``mb`` from."""
        if self.is_last:
            return self.losses[mb], [], []
        outputs, output_grads = backward_roots(self.outputs[mb], grads)
        return None, outputs, output_grads

    def backward_context(self, mb: int, split: bool) -> Any:
        """While an overlapped B of ``mb`` runs: the store defers weight GEMMs when ``split``."""
        if not self.compiled:
            return self._deferring(mb) if split else contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self._no_donation())
        if split:
            stack.enter_context(self._deferring(mb))
        return stack

    def forward_context(self, mb: int, other_split: bool) -> Any:
        """While a stage class's ``overlapped_forward_backward`` runs the F of ``mb`` beside a B on this thread:
        ``fused_forward`` when this F's backward is fused and the B beside it is too (a split B's recompute
        must still build deferring nodes)."""
        return fused_forward() if self._defers and not other_split and mb in self.fused else _NOTHING

    def _no_donation(self) -> Any:
        """A compiled stage's forward and backward: AOTAutograd donates no buffer (``compiled.py``); it
        reads the setting both when it compiles and when a compiled backward runs."""
        return compiled.without_buffer_donation() if self.compiled else contextlib.nullcontext()

    def finish_overlapped_backward(self, mb: int, split: bool) -> None:
        """After an overlapped B: its input grads are the inputs' ``.grad``; W runs the store's group."""
        input_grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None
                       for x in self.inputs[mb]]
        if split:
            self.pending_w[mb] = _STORE_ONLY
        self.after_backward(mb, input_grads, split)

    def weight(self, mb: int) -> None:
        """W: the weight gradients B left behind (the store's closures and/or the generic split's rest)."""
        w = self.pending_w.pop(mb, None)
        if w is not None:
            try:
                with self._no_donation():
                    self.store.run((self.chain, self.stage, mb))
                    if type(w) is tuple and w[1] is not None:
                        w[1].run()
            except PipelineError:
                raise
            except Exception as exc:
                raise self._error("W", mb, exc) from exc
        self._drop(mb)

    def _drop(self, mb: int) -> None:
        self.inputs.pop(mb, None)
        if not self.is_last:
            self.outputs.pop(mb, None)
