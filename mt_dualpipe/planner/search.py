"""The strategy planner: enumerate parallel layouts, estimate each, rank them.

Enumerates pipeline size (divisors of the GPU count), schedule (every registered hand schedule
that accepts the sizes; interleaved-1f1b with 2 virtual stages), micro-batch size and count
(global batch / data parallel / micro-batch size), expert-parallel size (divisors of the data-
parallel size that divide the experts), tensor-parallel size (``tp``: 1 unless asked, DeepSeek-V3's
own choice and what DualPipe's compute/communication overlap is designed for; Megatron-style with
sequence parallelism, costed in ``estimate``) and data parallel (the rest). Each candidate is
estimated by ``estimate`` (compute/communication model and this library's simulator); the ones
that fit in memory are ranked by step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..schedules.auto import PLACEMENTS
from ..schedules.errors import ScheduleError
from ..schedules.registry import schedule_info
from .activations import active_savers
from .estimate import AUTO, Estimate, Strategy, estimate, num_stages, ties_across_stages
from .model import ModelSpec
from .runnable import unrunnable_reasons, zero_from_config
from .system import SystemSpec

DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv", "dualpipev", "dualpipe")
VIRTUAL_STAGES = 2  # chunks per rank tried for schedules that take ``virtual_stages``


@dataclass
class PlanResult:
    model: ModelSpec
    system: SystemSpec
    gpus: int
    global_batch: int
    ranked: list[Estimate]                       # fitting configurations, fastest first
    rejected: list[Estimate] = field(default_factory=list)  # estimated but over the memory
    skipped: int = 0                             # combinations that do not exist (divisibility, schedule rules)
    not_runnable: int = 0                        # left out by ``runnable_only`` (the runtime cannot launch them)
    reference: Estimate | None = None            # the model's published configuration, when it has one
    reference_rank: int | None = None
    verdict: str = ""
    memory_savers: frozenset[str] = frozenset()  # the activation savers the estimates counted (the family's)

    def to_dict(self, top: int = 20) -> dict:
        return {"format": "mt-dualpipe.plan/1", "model": self.model.name, "system": self.system.name,
                "gpus": self.gpus, "global_batch": self.global_batch,
                "memory_savers": sorted(self.memory_savers),
                "configurations": [e.to_dict(self.memory_savers) for e in self.ranked[:top]],
                "over_memory": [e.to_dict(self.memory_savers)
                                for e in sorted(self.rejected, key=lambda e: e.step_time)[:top]],
                "skipped": self.skipped, "not_runnable_left_out": self.not_runnable,
                "reference": self.reference.to_dict(self.memory_savers) if self.reference else None,
                "reference_rank": self.reference_rank, "verdict": self.verdict}


def auto_placement(schedule: str) -> str | None:
    """The placement the ``auto`` search uses for a hand schedule's layout (the registry's), or None
    when the search does not take that placement (interleaved) or the schedule is auto itself."""
    if schedule == AUTO:
        return None
    placement = schedule_info(schedule).placement
    return placement if placement in PLACEMENTS else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelSpec, gpus: int, global_batch: int, *, pp: list[int] | None = None,
               ep: list[int] | None = None, schedules: tuple[str, ...] = DEFAULT_SCHEDULES,
               micro_batch_sizes: tuple[int, ...] = (1,), seq_len: int = 4096, dtype: str = "bf16",
               zero: int = 1, recompute: str = "selective", max_pp: int = 32, tp: list[int] | None = None
               ) -> tuple[list[Strategy], int]:
    """Every strategy the divisibility rules allow, and how many combinations they ruled out.
    ``tp``: the tensor-parallel sizes to try (default 1 only); ``dp`` is what pp x tp leaves."""
    for name in schedules:
        if name != AUTO:
            schedule_info(name)  # an unknown name fails here, with the list of known ones
    out: list[Strategy] = []
    skipped = 0
    pps = pp or [d for d in _divisors(gpus) if d <= max_pp]
    for t in tp or [1]:
        if t < 1 or gpus % t:
            raise ScheduleError(f"tensor-parallel size {t} does not divide {gpus} GPUs")
        for p in pps:
            if gpus % p:
                raise ScheduleError(f"pipeline size {p} does not divide {gpus} GPUs")
            if gpus % (p * t):
                skipped += 1
                continue
            dp = gpus // (p * t)
            if not model.is_moe:
                eps = [1]  # no experts: expert parallelism does not apply
            else:
                eps = ep or [e for e in _divisors(dp) if model.expert_num % e == 0]
            for e in eps:
                if dp % e or (model.is_moe and model.expert_num % e):
                    skipped += 1
                    continue
                for mbs in micro_batch_sizes:
                    if global_batch % (dp * mbs):
                        skipped += 1
                        continue
                    M = global_batch // (dp * mbs)
                    for sched in (schedules if p > 1 else ("1f1b",)):
                        v = VIRTUAL_STAGES if sched != AUTO and "virtual_stages" in schedule_info(sched).options \
                            else 1
                        out.append(Strategy(p, sched, M, e, dp, mbs, seq_len, zero, dtype, recompute, v, tp=t))
    return out, skipped


def plan(model: ModelSpec, system: SystemSpec, gpus: int, global_batch: int | None = None, *,
         reference: Strategy | None = None, auto_top: int = 0, runnable_only: bool = False, **options) -> PlanResult:
    """Estimate every candidate strategy; rank the ones that fit by step time.

    ``reference`` (default: the model's published ``training`` block, when it matches ``gpus``) is
    located in the ranking, and ``verdict`` says where it landed and, if it is not first, why the
    winner is faster. ``auto_top`` > 0 also searches the ``auto`` schedule (same placement, the
    measured stage costs, the leanest hand schedule's memory) for the best ``auto_top`` layouts.
    Every estimate says whether the runtime can launch it (``Estimate.runnable``, ``planner.runnable``);
    ``runnable_only`` leaves out the ones it cannot (counted in ``not_runnable``).
    """
    if gpus < 1:
        raise ScheduleError(f"--gpus must be a positive integer, got {gpus}")
    training = model.training or {}
    if global_batch is None:
        global_batch = int(training.get("global_batch_size", 0)) or None
    if not global_batch:
        raise ScheduleError("give the global batch size (sequences per step): the model description has none")
    options.setdefault("seq_len", int(training.get("seq_len", 4096)))
    if "dtype" not in options or options["dtype"] is None:
        options["dtype"] = training.get("dtype", "bf16")
    if options["dtype"] not in ("bf16", "fp8"):
        raise ScheduleError(f"dtype must be bf16 or fp8, got {options['dtype']!r}")
    strategies, skipped = candidates(model, gpus, global_batch, **options)
    not_runnable = 0
    if runnable_only:
        kept = [st for st in strategies if not unrunnable_reasons(st, ties_across_stages(model, num_stages(st)))]
        strategies, not_runnable = kept, len(strategies) - len(kept)
    ranked, rejected = [], []
    for st in strategies:
        try:
            est = estimate(model, system, st)
        except ScheduleError:
            skipped += 1
            continue
        (ranked if est.fits else rejected).append(est)
    ranked.sort(key=lambda e: (e.step_time, e.total_memory_gb))
    if auto_top:
        _add_auto(model, system, ranked, rejected, auto_top)
    result = PlanResult(model, system, gpus, global_batch, ranked, rejected, skipped, not_runnable=not_runnable,
                        memory_savers=active_savers())
    if reference is None:
        reference = _published(training, gpus, global_batch, options)
    if reference is not None:
        _place_reference(result, reference)
    return result


def _add_auto(model: ModelSpec, system: SystemSpec, ranked: list[Estimate], rejected: list[Estimate],
              auto_top: int) -> None:
    """Search ``auto`` on the placement of the ``auto_top`` best distinct layouts; re-rank ``ranked``."""
    tried: set = set()
    for est in list(ranked):
        s = est.strategy
        placement = auto_placement(s.schedule)
        key = (s.pp, s.num_microbatches, s.ep, s.micro_batch_size, placement)
        if placement is None or key in tried:
            continue
        tried.add(key)
        try:
            got = estimate(model, system, replace(s, schedule=AUTO, placement=placement))
        except ScheduleError:
            continue
        (ranked if got.fits else rejected).append(got)
        if len(tried) >= auto_top:
            break
    ranked.sort(key=lambda e: (e.step_time, e.total_memory_gb))


def _published(training: dict, gpus: int, global_batch: int, options: dict) -> Strategy | None:
    """The model's published configuration (its ``training`` block) when it was for ``gpus`` GPUs."""
    if training.get("gpus") != gpus or not training.get("pp_size"):
        return None
    p, t = int(training["pp_size"]), int(training.get("tp_size", 1))
    dp = gpus // (p * t)
    mbs = int(training.get("micro_batch_size", 1))
    if global_batch % (dp * mbs):
        return None
    return Strategy(p, training.get("schedule", "1f1b"), global_batch // (dp * mbs),
                    int(training.get("ep_size", 1)), dp, mbs, options["seq_len"],
                    zero_from_config(training.get("zero_state", 1)), options["dtype"],
                    options.get("recompute", "selective"), tp=t)


def _place_reference(result: PlanResult, ref: Strategy) -> None:
    def same(e: Estimate) -> bool:
        s = e.strategy
        return (s.pp, s.schedule, s.num_microbatches, s.ep, s.dp, s.micro_batch_size, s.tp) == \
            (ref.pp, ref.schedule, ref.num_microbatches, ref.ep, ref.dp, ref.micro_batch_size, ref.tp)

    for i, e in enumerate(result.ranked):
        if same(e):
            result.reference, result.reference_rank = e, i + 1
            break
    else:
        try:
            result.reference = estimate(result.model, result.system, ref)
        except ScheduleError as exc:
            result.verdict = f"the published configuration ({ref.describe()}) is not valid here: {exc}"
            return
    ref_est = result.reference
    if not result.ranked:
        result.verdict = "no configuration fits in memory"
        return
    best = result.ranked[0]
    if result.reference_rank == 1:
        result.verdict = f"the published configuration ({ref.describe()}) ranks first"
        return
    cap = result.system.gpu_memory_gb * result.system.mem_factor
    where = f"ranks #{result.reference_rank} of {len(result.ranked)}" if result.reference_rank else \
        f"does not fit ({ref_est.total_memory_gb:.1f} GB > {cap:.1f})"
    why = []
    if best.pipeline_time < ref_est.pipeline_time:
        why.append(f"pipeline {best.pipeline_time:.2f}s vs {ref_est.pipeline_time:.2f}s "
                   f"(bubble {best.bubble_rate:.1%} vs {ref_est.bubble_rate:.1%})")
    a2a_best = max(best.costs.a2a_f) if best.costs and isinstance(best.costs.a2a_f, list) else 0.0
    a2a_ref = max(ref_est.costs.a2a_f) if ref_est.costs and isinstance(ref_est.costs.a2a_f, list) else 0.0
    if best.strategy.ep != ref.ep and a2a_best < a2a_ref:
        why.append(f"all-to-all of one stage forward {a2a_best * 1e3:.1f} ms vs {a2a_ref * 1e3:.1f} ms "
                   f"(EP {best.strategy.ep} vs {ref.ep}: fewer nodes per expert group, less InfiniBand traffic)")
    if best.dp_sync_time < ref_est.dp_sync_time:
        why.append(f"gradient sync {best.dp_sync_time:.2f}s vs {ref_est.dp_sync_time:.2f}s")
    gap = ref_est.step_time / best.step_time - 1
    result.verdict = (f"the published configuration ({ref.describe()}) {where}, {gap:.1%} slower than "
                      f"{best.strategy.describe()}" + (": " + "; ".join(why) if why else ""))
