"""What the runtime can launch today, and the launch knobs of a planned configuration.

The planner models more than the runtime runs: it could model tensor parallelism, which the
runtime does not launch. Recompute none / selective / full is applied by the DeepSeek-V3 and Llama
integrations when their stages are built (``integrations/recompute.py``), so every policy the planner
estimates is runnable. A configuration is offered as *runnable* only when
every knob it needs is one the runtime has; otherwise it carries the reasons, so ``mt-dualpipe
plan`` marks it (or leaves it out with ``--runnable-only``) instead of recommending what cannot be
launched. When the runtime gains a knob, widen the tuple here: nothing else needs to change.

``launch(strategy)`` is the tuple a launcher needs, in the runtime's terms
(``mt_dualpipe.parallel.init_parallel(pp, dp, ep, tp)`` and ``GradSync(mode=dp_mode)``): the
planner counts data parallelism Megatron's way (its ``dp`` includes the expert-parallel ranks),
the mesh counts full-model replicas, so ``launch["dp"] = strategy.dp // strategy.ep`` and
``pp * dp * ep * tp`` is the GPU count (``parallel/mesh.py`` explains both conventions).

``demo_command(launch)`` turns that tuple into a command line for ``examples/deepseek_v3_repro.py``
(``--pp --dp --ep --dp-mode --schedule --microbatches --recompute``): the planned layout in
miniature, the tiny DeepSeek-V3 preset on local gloo processes (``mt-dualpipe plan`` prints it for
the best runnable row and puts it in the JSON). Tensor parallelism is refused for MoE models: the
runtime's tensor-parallel stages are dense ones (the DeepSeek-V3 stages shard experts over ep only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .estimate import Strategy

RUNTIME_DP_MODES: tuple[str, ...] = ("allreduce", "zero1")
"""``mt_dualpipe.parallel.MODES``: the data-parallel modes ``GradSync`` runs (a test keeps them equal)."""
RUNTIME_RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
"""Recompute policies the runtime's stages apply (``integrations.recompute.POLICIES``; a test keeps them equal)."""
RUNTIME_TP: tuple[int, ...] = (1,)
"""Tensor-parallel sizes the launch path runs (the planner models tp = 1 only)."""


def dp_mode(strategy: Strategy) -> str:
    """The runtime's data-parallel mode for the strategy's ZeRO stage: ZeRO-1 shards the optimizer
    state and reduce-scatters gradients ("zero1"); ZeRO-0 all-reduces them ("allreduce")."""
    return "zero1" if strategy.zero >= 1 else "allreduce"


def launch(strategy: Strategy) -> dict:
    """The launchable tuple ``(pp, dp, ep, tp, schedule, microbatches, dp_mode, recompute)`` in the
    runtime's terms, plus the schedule's build options and the micro-batch size."""
    from .estimate import schedule_options

    return {"pp": strategy.pp, "dp": strategy.dp // strategy.ep, "ep": strategy.ep, "tp": 1,
            "schedule": strategy.schedule, "microbatches": strategy.num_microbatches,
            "dp_mode": dp_mode(strategy), "recompute": strategy.recompute,
            "schedule_options": schedule_options(strategy), "micro_batch_size": strategy.micro_batch_size}


DEMO = "examples/deepseek_v3_repro.py"
"""The demo ``demo_command`` launches (the DeepSeek-V3 miniature)."""


def demo_command(launch: dict, python: str = "python") -> str | None:
    """The demo's command line for a ``launch`` tuple, or None when the demo cannot take one of its knobs
    (tensor parallelism, or schedule options other than interleaved-1f1b's virtual stages, such as a
    searched ``auto`` schedule's placement)."""
    options = dict(launch.get("schedule_options") or {})
    virtual = options.pop("virtual_stages", None)
    if launch["tp"] != 1 or options:
        return None
    words = [python, DEMO, "--pp", launch["pp"], "--dp", launch["dp"], "--ep", launch["ep"],
             "--dp-mode", launch["dp_mode"], "--schedule", launch["schedule"],
             "--microbatches", launch["microbatches"], "--recompute", launch["recompute"]]
    if virtual is not None:
        words += ["--virtual-stages", virtual]
    if launch.get("micro_batch_size"):
        words += ["--micro-batch-size", launch["micro_batch_size"]]
    return " ".join(str(w) for w in words)


def unrunnable_reasons(strategy: Strategy) -> list[str]:
    """Why the runtime cannot launch ``strategy`` (empty when it can)."""
    out = []
    if strategy.recompute not in RUNTIME_RECOMPUTE:
        out.append(f"recompute {strategy.recompute!r} is not applied by the runtime's stages (runnable: "
                   f"{', '.join(RUNTIME_RECOMPUTE)})")
    tp = getattr(strategy, "tp", 1)  # the planner models tp = 1; a strategy that carries a tp is checked
    if tp not in RUNTIME_TP:
        out.append(f"tp {tp} is not launched by the runtime (runnable: {', '.join(map(str, RUNTIME_TP))})")
    elif tp > 1 and getattr(strategy, "ep", 1) > 1:
        out.append(f"tp {tp} with expert parallelism is not launched: tensor-parallel stages are dense only (MoE "
                   "stages shard experts over ep, not tp)")
    if dp_mode(strategy) not in RUNTIME_DP_MODES:
        out.append(f"dp_mode {dp_mode(strategy)!r} is not run by the runtime (runnable: {', '.join(RUNTIME_DP_MODES)})")
    return out


def short_reason(reasons: list[str]) -> str:
    """The table's cell: "yes", or the knobs that block a launch ("no: recompute")."""
    if not reasons:
        return "yes"
    return "no: " + ", ".join(r.split()[0] for r in reasons)
