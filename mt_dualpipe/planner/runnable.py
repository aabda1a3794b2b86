"""What the runtime can launch today, and the launch knobs of a planned configuration.

The planner models more than the runtime runs: it could model tensor parallelism, which the
runtime does not launch. Recompute none / selective / full is applied by every family's stages when
they are built (``models/recompute.py``), so every policy the planner
estimates is runnable. A configuration is offered as *runnable* only when
every knob it needs is one the runtime has; otherwise it carries the reasons, so ``mt-dualpipe
plan`` marks it (or leaves it out with ``--runnable-only``) instead of recommending what cannot be
launched. The data-parallel modes and what each runs with are the runtime's own table
(``parallel.modes.DP_MODES``): a strategy's ZeRO stage names its mode (0 allreduce, 1 zero1,
3 fsdp), and the mode's flags decide, so ``fsdp`` is runnable exactly where the runtime runs it.

``launch(strategy)`` is the tuple a launcher needs, in the runtime's terms
(``mt_dualpipe.parallel.init_parallel(pp, dp, ep, tp)`` and ``GradSync(mode=dp_mode)``): the
planner counts data parallelism Megatron's way (its ``dp`` includes the expert-parallel ranks),
the mesh counts full-model replicas, so ``launch["dp"] = strategy.dp // strategy.ep`` and
``pp * dp * ep * tp`` is the GPU count (``parallel/mesh.py`` explains both conventions).

``demo_command(launch, family)`` turns that tuple into a command line for the planned family's example
(``planner/families.py``): ``examples/deepseek_v3_repro.py`` for DeepSeek-V3, ``examples/train_family.py
--family MODEL_TYPE`` for a family on the shared decoder stages (Qwen3-MoE, Llama), with ``--pp --dp --ep
--dp-mode --schedule --microbatches --recompute`` and a miniature's ``--layers --vocab-size --seq-len --steps``:
the planned layout in miniature, the family's own tiny preset on local gloo processes (``mt-dualpipe plan``
prints it for the best runnable row and puts it in the JSON). Where the example cannot take a knob
(``command_refusal``) there is no command, and the plan says why. The miniature runs at pp 2 by default;
``miniature(..., keep_pp=True)`` keeps the plan's pp, one process per pipeline rank, at small sizes, with the
tiny preset deepened to the fewest layers that give every stage a block (DeepSeek-V3:
``stage_fill.layers_to_fill``, 4 layers cannot fill DualPipe's 8 stages, and with a recompute policy the first
stage needs one too; the shared decoder stages: one layer per stage of a chain).
Tensor parallelism is refused for MoE models: the runtime's tensor-parallel stages are dense ones
(the DeepSeek-V3 stages shard experts over ep only).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

from ..parallel.modes import DP_MODES, DataParallelMode, mode_for_zero_stage
from ..schedules.registry import has_fb_units
from .families import DEEPSEEK_V3, FAMILY_EXAMPLE, PlannedFamily
from .model import ModelSpec
from .stage_fill import layers_to_fill, placement_of, runs_at
from .strategy import Strategy, schedule_options

RUNTIME_RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
"""Recompute policies the runtime's stages apply (``models.recompute.POLICIES``; a test keeps them equal)."""
RUNTIME_TP: tuple[int, ...] = (1,)
"""Tensor-parallel sizes the launch path runs. The planner estimates any tp (Megatron-style, with sequence
parallelism); the runtime's tensor-parallel stages (``parallel/tensor_parallel.py``: dense Llama blocks,
no sequence parallelism, data-parallel modes whose ``tensor_parallel`` flag is set) are not reached by
the launch path the plan prints (the families' examples), so a tp > 1 layout is estimated and marked, not
offered."""


ZERO_STAGES: tuple[int, ...] = tuple(sorted({m.zero_stage for m in DP_MODES.values()}))
"""The ZeRO stages some runtime mode runs (the CLI's ``--zero`` choices)."""


def zero_from_config(value: int) -> int:
    """A configuration's ZeRO stage (DeepSpeed's ``zero_optimization.stage``, a model card's ``zero_state``)
    as the planner's: 0, 1 and 3 as they are; 2 as 1, since the runtime's zero1 already drops the full
    gradients at the reduce-scatter and keeps only this rank's shard (ZeRO-2's saving between steps)."""
    if isinstance(value, bool) or value not in (0, 1, 2, 3):
        raise ValueError(f"zero_state {value!r} is not a ZeRO stage; allowed: 0, 1, 2 (run as 1), 3")
    stage = int(value)
    return 1 if stage == 2 else stage


def dp_mode(strategy: Strategy) -> str:
    """The runtime's data-parallel mode for the strategy's ZeRO stage (``parallel.modes.mode_for_zero_stage``):
    0 all-reduces ("allreduce"), 1 reduce-scatters and shards the optimizer state ("zero1"), 3 runs
    ``fully_shard`` stages ("fsdp")."""
    return mode_for_zero_stage(strategy.zero).name


CORE_ATTENTION = {"fused": "flash", "eager": "eager"}
"""The planner's attention kind -> the runtime's ``core_attention`` that keeps what it counts (the flash-style
MLA core keeps q, k, v, the output and one log-sum-exp per head: ``layers/flash_core.py``)."""


def launch(strategy: Strategy, memory_savers: Iterable[str] = ()) -> dict:
    """The launchable tuple ``(pp, dp, ep, tp, schedule, microbatches, dp_mode, recompute)`` in the
    runtime's terms, plus the schedule's build options, the micro-batch size, the core attention the
    estimate counted and the activation savers it counted (``memory_savers``, the plan's)."""
    return {"pp": strategy.pp, "dp": strategy.dp // strategy.ep, "ep": strategy.ep, "tp": strategy.tp,
            "schedule": strategy.schedule, "microbatches": strategy.num_microbatches,
            "dp_mode": dp_mode(strategy), "recompute": strategy.recompute,
            "schedule_options": schedule_options(strategy), "micro_batch_size": strategy.micro_batch_size,
            "core_attention": CORE_ATTENTION[strategy.attention],
            "memory_savers": ",".join(sorted(memory_savers)) or "none"}


DEMO = DEEPSEEK_V3.example
"""The DeepSeek-V3 demo (its miniature); every other family runs in ``families.FAMILY_EXAMPLE``."""


def command_refusal(launch: dict, family: PlannedFamily = DEEPSEEK_V3) -> str | None:
    """Why ``family``'s example cannot take ``launch`` (None when it can): a model with no family the runtime
    builds, tensor parallelism, schedule options other than interleaved-1f1b's virtual stages (a searched
    ``auto`` schedule's placement), fully_shard-ed stages for DeepSeek-V3 (its experts and dense weights reduce
    over different groups, which one fully_shard mesh cannot express)."""
    if family.example is None:
        return (f"{family.title} is not one of the families the runtime builds (plan a family's preset or "
                "config.json, or deepseek-v3)")
    options = dict(launch.get("schedule_options") or {})
    options.pop("virtual_stages", None)
    if launch["tp"] != 1:
        return f"tp {launch['tp']}: {family.example} runs no tensor-parallel stages"
    if options:
        return f"schedule options {options} (a searched schedule's placement) are not options of {family.example}"
    if DP_MODES[launch["dp_mode"]].needs_fully_shard and family is DEEPSEEK_V3:
        return f"dp_mode {launch['dp_mode']!r}: the DeepSeek-V3 demo's stages are not fully_shard-ed"
    return None


def demo_command(launch: dict, family: PlannedFamily = DEEPSEEK_V3, python: str = "python") -> str | None:
    """The command line of ``family``'s example for a ``launch`` tuple (DeepSeek-V3: ``DEMO``; any other family:
    ``families.FAMILY_EXAMPLE --family MODEL_TYPE``), or None where ``command_refusal`` gives a reason. The core
    attention travels only to a family whose modules offer a choice of it (DeepSeek-V3's flash-style MLA core)."""
    if command_refusal(launch, family) is not None:
        return None
    words: list = [python, family.example]
    if family.example == FAMILY_EXAMPLE:
        words += ["--family", family.model_type]
    words += ["--pp", launch["pp"], "--dp", launch["dp"], "--ep", launch["ep"], "--dp-mode", launch["dp_mode"],
              "--schedule", launch["schedule"]]
    if launch.get("microbatches"):
        words += ["--microbatches", launch["microbatches"]]
    words += ["--recompute", launch["recompute"]]
    virtual = (launch.get("schedule_options") or {}).get("virtual_stages")
    if virtual is not None:
        words += ["--virtual-stages", virtual]
    for key in ("layers", "vocab_size", "seq_len", "steps"):  # a miniature's sizes (``miniature(keep_pp=True)``)
        if launch.get(key):
            words += [f"--{key.replace('_', '-')}", launch[key]]
    if launch.get("micro_batch_size"):
        words += ["--micro-batch-size", launch["micro_batch_size"]]
    if family.flash_core and launch.get("core_attention", "eager") != "eager":
        words += ["--core-attention", launch["core_attention"]]
    if launch.get("memory_savers", "none") != "none":
        words += ["--memory-savers", launch["memory_savers"]]
    return " ".join(str(w) for w in words)


MINIATURE_PROCESSES = 4
"""Local processes a miniature takes at most (``miniature``): what a laptop runs in a minute."""
TINY_DEEPSEEK: dict[str, int] = dict(
    vocab_size=1024, dim=256, inter_dim=512, moe_inter_dim=128, n_layers=4, n_dense_layers=1, n_heads=4,
    n_routed_experts=16, n_shared_experts=1, n_activated_experts=4, q_lora_rank=64, kv_lora_rank=32,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mtp_depth=1)
"""The shape of the demo's ``tiny`` DeepSeek-V3 preset (``DeepSeekV3Config.preset("tiny")``, which the planner
cannot import without torch; a test holds the two equal): what the miniature's stage cut is modelled on."""
TINY_EXPERTS = TINY_DEEPSEEK["n_routed_experts"]
"""Routed experts of the tiny preset: the miniature's ep divides them (``families.DEEPSEEK_V3.tiny_experts``)."""
DEEP_MINIATURE: dict[str, int] = {"micro_batch_size": 1, "seq_len": 16, "vocab_size": 128, "steps": 20}
"""The demo's sizes for a miniature at the plan's own pp (``miniature(keep_pp=True)``): one 16-token sequence per
micro-batch over a 128-token vocabulary, 20 steps, 2 x pp micro-batches where the schedule takes that many, so
that 16 processes on 2 cores finish in minutes with the loss falling (the README's pp 8 and pp 16 figures were
measured at these sizes)."""


def tiny_spec(layers: int, vocab_size: int | None = None) -> ModelSpec:
    """The tiny preset with ``layers`` blocks (and ``vocab_size``), as the planner models it
    (``ModelSpec.from_deepseek_config``)."""
    shape = {**TINY_DEEPSEEK, "n_layers": layers, "vocab_size": vocab_size or TINY_DEEPSEEK["vocab_size"]}
    return ModelSpec.from_deepseek_config(SimpleNamespace(**shape))


def miniature(launch: dict, family: PlannedFamily = DEEPSEEK_V3, keep_pp: bool = False,
              experts: int | None = None) -> dict:
    """``launch`` shrunk to ``family``'s tiny preset on local processes: the same schedule, schedule options,
    data-parallel mode, recompute policy, core attention and savers, on pp 2 and at most ``MINIATURE_PROCESSES``
    ranks (ep: the largest divisor of the preset's routed experts, ``experts`` if given, up to the plan's ep and
    what pp leaves; 1 for a dense family; dp: what is left), with the example's own micro-batch count and size.
    What the plan's layout means at scale is the launch tuple; this is the same program at a size that runs here.

    ``keep_pp``: at the plan's own pp instead (dp and ep 1 once pp reaches ``MINIATURE_PROCESSES``), at the
    sizes of ``DEEP_MINIATURE`` and 2 x pp micro-batches (the fewest ZB-V, DualPipe and DualPipeV take).
    DeepSeek-V3's preset is deepened (``"layers"``) to the fewest blocks whose balanced cut at those sizes gives
    every stage one (``stage_fill.layers_to_fill``, the first stage included under a recompute policy); a family
    on the shared decoder stages, cut evenly (``models/decoder_stage.py``: ``stage_layer_ids``), to one layer per
    stage of a chain wherever its preset has fewer, at pp 2 as well."""
    experts = family.tiny_experts if experts is None else experts
    pp = launch["pp"] if keep_pp else 2
    room = max(1, MINIATURE_PROCESSES // pp)
    ep = max(d for d in range(1, min(launch["ep"], room) + 1) if max(experts, 1) % d == 0)
    dp = max(1, min(launch["dp"], room // ep))
    out = {**launch, "pp": pp, "dp": dp, "ep": ep, "microbatches": None, "micro_batch_size": None, "layers": None}
    if keep_pp:
        out.update(DEEP_MINIATURE)
        if runs_at(launch["schedule"], pp, launch.get("schedule_options"), 2 * pp):
            out["microbatches"] = 2 * pp
    placement = placement_of(launch["schedule"], pp, launch.get("schedule_options"))
    if placement is None:
        return out
    if family is not DEEPSEEK_V3:
        layers = max(family.tiny_layers, len(placement[0]))
        out["layers"] = layers if layers != family.tiny_layers else None
    elif keep_pp:
        layers = layers_to_fill(lambda k: tiny_spec(k, DEEP_MINIATURE["vocab_size"]), placement,
                                DEEP_MINIATURE["seq_len"], least=TINY_DEEPSEEK["n_layers"],
                                first=launch["recompute"] != "none", fb_units=has_fb_units(launch["schedule"]))
        out["layers"] = layers if layers != TINY_DEEPSEEK["n_layers"] else None
    return out


def unrunnable_reasons(strategy: Strategy, tied: bool = False) -> list[str]:
    """Why the runtime cannot launch ``strategy`` (empty when it can). ``tied``: the model ties weights
    across pipeline stages (DeepSeek-V3's MTP shares the embedding of the first stage)."""
    out = []
    if strategy.recompute not in RUNTIME_RECOMPUTE:
        out.append(f"recompute {strategy.recompute!r} is not applied by the runtime's stages (runnable: "
                   f"{', '.join(RUNTIME_RECOMPUTE)})")
    tp = strategy.tp
    if tp not in RUNTIME_TP:
        out.append(f"tp {tp} is not launched by the runtime (runnable: {', '.join(map(str, RUNTIME_TP))})")
    elif tp > 1 and strategy.zero in ZERO_STAGES and not mode_for_zero_stage(strategy.zero).tensor_parallel:
        out.append(f"dp_mode {dp_mode(strategy)!r} (zero {strategy.zero}) does not reduce tensor-parallel shards "
                   f"(parallel.modes.DP_MODES: tensor_parallel); tp {tp} runs with zero 0")
    elif tp > 1 and getattr(strategy, "ep", 1) > 1:
        out.append(f"tp {tp} with expert parallelism is not launched: tensor-parallel stages are dense only (MoE "
                   "stages shard experts over ep, not tp)")
    zero = getattr(strategy, "zero", 1)
    if zero not in ZERO_STAGES:
        out.append(f"zero {zero} is not run by the runtime (runnable: {', '.join(map(str, ZERO_STAGES))})")
        return out
    out += _mode_reasons(mode_for_zero_stage(zero), getattr(strategy, "ep", 1), tied)
    return out


def _mode_reasons(mode: DataParallelMode, ep: int, tied: bool) -> list[str]:
    """What the mode's row refuses (the runtime's own refusals, ``runtime.data_parallel.needs_reductions``)."""
    out = []
    if ep > 1 and not mode.expert_parallel:
        able = ", ".join(m.name for m in DP_MODES.values() if m.expert_parallel)
        out.append(f"dp_mode {mode.name!r} (zero {mode.zero_stage}) with ep {ep} is not run by the runtime "
                   f"(with expert parallelism: {able})")
    if tied and not mode.tied_weights:
        able = ", ".join(m.name for m in DP_MODES.values() if m.tied_weights)
        out.append(f"dp_mode {mode.name!r} (zero {mode.zero_stage}) cannot reduce weights tied across stages (the "
                   f"MTP module's embedding): the runtime refuses it (with tied weights: {able})")
    return out


def short_reason(reasons: list[str]) -> str:
    """The table's cell: "yes", or the knobs that block a launch ("no: recompute")."""
    if not reasons:
        return "yes"
    return "no: " + ", ".join(r.split()[0] for r in reasons)
