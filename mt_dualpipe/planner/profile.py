"""Measure a real pipeline's per-stage costs on this machine, so ``auto`` schedules what it does.

``profile(stage_modules, sample_inputs)`` runs every stage of a chain in this process, the way the
runtime runs it (``runtime.stage.Stage``: F, then B with the weight gradients deferred, then W),
and times each part on the local device (median of ``repeats`` after ``warmup``), synchronising
CUDA/MUSA around every timed op. It also counts the bytes autograd saves for the backward per
micro-batch (what a stage's in-flight activation costs), for the planner's memory model.

Communication: with ``torch.distributed`` initialised and at least two ranks, ``profile`` is a
collective (every rank calls it): ranks 0 and 1 ping-pong the largest stage output and the
one-way time becomes ``comm``; with ``a2a_bytes`` an ``all_to_all_single`` of that many bytes per
rank is timed and charged to ``a2a_f``/``a2a_b`` once per MoE layer of a stage (a module's
``moe_layers`` attribute; 1 when it has none). Single-process,
``comm`` and the all-to-all are taken from the arguments (default 0).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.device import collective_device
from ..runtime.stage import Stage
from ..runtime.weight_grad import WeightGradStore
from ..schedules.costs import Costs


@dataclass
class StageProfile:
    """Measured per-stage times (seconds) and sizes (bytes) of one micro-batch."""

    f: list[float]
    b: list[float]
    w: list[float]
    bw: list[float]
    comm: float = 0.0
    a2a: list[float] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    output_bytes: list[int] = field(default_factory=list)

    def costs(self) -> Costs:
        a2a = self.a2a or [0.0] * len(self.f)
        return Costs(f=list(self.f), b=list(self.b), w=list(self.w), comm=self.comm, a2a_f=list(a2a),
                     a2a_b=list(a2a))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "musa" and hasattr(torch, "musa"):
        torch.musa.synchronize(device)


def _device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def _leaf_inputs(values: Sequence[Any]) -> tuple:
    """Detached copies of a stage's inputs; floating tensors require grad like a received activation."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            if v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return tuple(out)


class SavedBytes:
    """Bytes of the distinct storages autograd saves inside the ``with`` block (``exclude``: parameters).

    Public because it is how one measures what one in-flight micro-batch keeps alive: ``profile``
    uses it per stage, and the planner's memory test checks its estimate against it.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self.seen: set[int] = {t.untyped_storage().data_ptr() for t in exclude}  # parameters are not activations
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    def __enter__(self) -> SavedBytes:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def p2p_time(nbytes: int, device: torch.device, repeats: int = 5, group: dist.ProcessGroup | None = None) -> float:
    """One-way point-to-point time of ``nbytes`` between ranks 0 and 1 (a collective: all ranks call it)."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return 0.0
    rank = dist.get_rank(group)
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    result = torch.zeros(1, dtype=torch.float64, device=collective_device(group))
    if rank in (0, 1):
        peer = 1 - rank
        times = []
        for i in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            _sync(device)
            if i:
                times.append((time.perf_counter() - t0) / 2)
        result[0] = statistics.median(times)
    dist.broadcast(result, 0, group=group)
    return float(result[0])


def a2a_time(nbytes: int, device: torch.device, repeats: int = 5, group: dist.ProcessGroup | None = None) -> float:
    """Time of an ``all_to_all_single`` moving ``nbytes`` out of every rank (a collective)."""
    if not dist.is_initialized() or dist.get_world_size(group) < 2:
        return 0.0
    n = dist.get_world_size(group)
    per = max(1, nbytes // 4 // n)
    send = torch.zeros(per * n, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def _profile_stage(st: Stage, prof: StageProfile, inputs: tuple, crit: Callable | None, labels: Sequence[Any],
                   warmup: int, repeats: int) -> tuple:
    """Time one stage's F, B, W and BW, count its saved bytes; append to ``prof``; return its outputs."""
    module = st.module
    device = _device(module)
    counter = iter(range(1 << 30))

    def run_f() -> tuple[int, tuple]:
        mb = next(counter)
        x = _leaf_inputs(inputs) if st.stage else tuple(inputs)
        return mb, st.forward(mb, x, crit, labels if st.is_last else (), True, False)

    def grads_for(outs: tuple) -> list | None:
        if st.is_last:
            return None
        return [torch.randn_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None for o in outs]

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        return time.perf_counter() - t0, out

    times: dict[str, list[float]] = {"f": [], "b": [], "w": [], "bw": []}
    for i in range(warmup + repeats):
        t_f, (m, outs) = timed(run_f)
        g = grads_for(outs)
        t_b, _ = timed(lambda m=m, g=g: st.backward(m, g, True))
        t_w, _ = timed(lambda m=m: st.weight(m))
        _, (m2, outs2) = timed(run_f)
        g2 = grads_for(outs2)
        t_bw, _ = timed(lambda m=m2, g=g2: st.backward(m, g, False))
        if i >= warmup:
            for key, t in (("f", t_f), ("b", t_b), ("w", t_w), ("bw", t_bw)):
                times[key].append(t)
    with SavedBytes(list(module.parameters())) as saved:
        m, outs = run_f()
    st.backward(m, grads_for(outs), False)
    st.reset()
    module.zero_grad(set_to_none=True)
    for key in ("f", "b", "w", "bw"):
        getattr(prof, key).append(statistics.median(times[key]))
    prof.activation_bytes.append(saved.bytes)
    prof.param_bytes.append(sum(p.numel() * p.element_size() for p in module.parameters()))
    prof.output_bytes.append(sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor)))
    return outs


def profile_stages(stage_modules: Sequence[nn.Module], sample_inputs: Sequence[Any], *,
                   criterion: Callable | None = None, labels: Sequence[Any] = (), warmup: int = 1, repeats: int = 3,
                   comm: float | None = None, a2a: float | Sequence[float] | None = None,
                   a2a_bytes: int | None = None, process_group: dist.ProcessGroup | None = None) -> StageProfile:
    """Time F, B, W (and BW) of every stage of one chain; see the module docstring."""
    modules = list(getattr(stage_modules, "module", stage_modules))
    if not modules:
        raise ValueError("profile needs at least one stage module")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"profile needs warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    S = len(modules)
    if criterion is None:
        def criterion(*outs: Any) -> torch.Tensor:  # noqa: ANN401 - any output pytree
            return sum(o.float().mean() for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point())
        crit_labels: Sequence[Any] = ()
    else:
        crit_labels = labels
    store = WeightGradStore()
    prof = StageProfile([], [], [], [])
    inputs = tuple(sample_inputs)
    for s, module in enumerate(modules):
        st = Stage(module, 0, s, s == 0, s == S - 1, store)
        outs = _profile_stage(st, prof, inputs, criterion if s == S - 1 else None, crit_labels, warmup, repeats)
        inputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    device = _device(modules[0])
    if comm is not None:
        prof.comm = float(comm)
    else:
        prof.comm = p2p_time(max(prof.output_bytes[:-1] or [0]), device, group=process_group)
    if a2a is not None:
        prof.a2a = [float(a2a)] * S if isinstance(a2a, (int, float)) else [float(x) for x in a2a]
    elif a2a_bytes:
        t = a2a_time(int(a2a_bytes), device, group=process_group)
        prof.a2a = [t * int(getattr(m, "moe_layers", 1)) for m in modules]
    else:
        prof.a2a = [0.0] * S
    return prof


def profile(stage_modules: Sequence[nn.Module], sample_inputs: Sequence[Any], **options: Any) -> Costs:
    """Measured ``Costs`` of a chain of stage modules on this machine (see ``profile_stages``).

    Feed the result to ``build_schedule("auto", P, M, costs=...)``; per-stage lists are indexed by
    the stage's position in its chain, as every ``Costs`` is.
    """
    return profile_stages(stage_modules, sample_inputs, **options).costs()
