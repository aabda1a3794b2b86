"""An exponential moving average of the parameters, kept on the CPU, updated in the background.

DeepSeek-V3 (report §3.3.1) keeps an EMA of the weights in CPU memory and updates it
asynchronously after each step, to judge the run early (evaluate the EMA) without spending
accelerator memory or step time. ``update()`` returns at once: accelerator parameters are copied
to pinned CPU buffers with non-blocking copies (ordered on the current stream before the next
optimizer step), and a single worker thread waits for those copies and applies
``ema ← decay·ema + (1 − decay)·p`` in float32. The optimizer's next ``step`` must not change the
parameters under a CPU-resident read, so when an optimizer is given a step pre-hook waits for the
pending update first (on the CPU the worker reads the parameters themselves, during the next
forward/backward, which only read them).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn


class CpuEMA:
    """EMA of ``module``'s parameters (float32, on the CPU) with ``decay`` in [0, 1)."""

    def __init__(self, module: nn.Module, decay: float = 0.999, optimizer: torch.optim.Optimizer | None = None) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.names = [n for n, p in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.shadow = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.staging = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) if p.is_cuda else None
                        for p in self.params]
        self.updates = 0
        self.pending: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-ema")
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.wait()) if optimizer is not None else None

    def update(self) -> Future:
        """Start folding the current parameters into the EMA; returns the background job."""
        self.wait()
        event = None
        if any(s is not None for s in self.staging):
            for buf, p in zip(self.staging, self.params):
                if buf is not None:
                    buf.copy_(p.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending = self._pool.submit(self._fold, event)
        return self.pending

    @torch.no_grad()
    def _fold(self, event: Any) -> None:
        if event is not None:
            event.synchronize()
        for avg, buf, p in zip(self.shadow, self.staging, self.params):
            src = buf if buf is not None else p.detach()
            avg.lerp_(src.float(), 1 - self.decay)
        self.updates += 1

    def wait(self) -> None:
        """Block until the pending update (if any) is folded in; re-raises its error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def state_dict(self) -> dict[str, Any]:
        """The averaged parameters by name (CPU float32) and the update count."""
        self.wait()
        return {"decay": self.decay, "updates": self.updates,
                "params": {n: t.clone() for n, t in zip(self.names, self.shadow)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait()
        missing = sorted(set(self.names) - set(state["params"]))
        if missing:
            raise ValueError(f"EMA state lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for n, avg in zip(self.names, self.shadow):
            avg.copy_(state["params"][n])
        self.decay, self.updates = float(state["decay"]), int(state["updates"])

    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> None:
        """Write the averaged weights into ``module`` (e.g. an evaluation copy of the model)."""
        self.wait()
        own = dict(module.named_parameters())
        for n, avg in zip(self.names, self.shadow):
            own[n].copy_(avg)

    def close(self) -> None:
        self.wait()
        if self._hook is not None:
            self._hook.remove()
        self._pool.shutdown(wait=True)
