"""``mt-dualpipe plan``: rank parallel strategies for a model on a modelled cluster (nothing is launched)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from ..models.planner_specs import planner_model, planner_names
from ..models.registry import planned_families
from ..planner import ModelSpec, plan
from ..planner.activations import memory_savers
from ..planner.families import PlannedFamily, family_of
from ..planner.report import print_plan
from ..planner.runnable import ZERO_STAGES, command_refusal, demo_command, launch, miniature, zero_from_config
from ..planner.search import PlanResult
from ..planner.system import load_system, parse_size_gb
from ..schedules.errors import ScheduleError


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="rank pipeline / expert / data parallel layouts for a model on a modelled cluster",
        description="Enumerate pipeline size, schedule, micro-batches and expert/data-parallel splits; estimate "
                    "step time (compute/communication model + the schedule simulator, with each stage's "
                    "data-parallel gradient reduction overlapping the pipeline's drain) and peak memory per GPU; "
                    "print the best. The cluster is a model: nothing is launched. Every configuration says "
                    "whether the runtime can launch it (column 'run', JSON 'runnable' with the reasons and "
                    "'launch' with pp, dp, ep, tp, schedule, microbatches, dp_mode, recompute in the runtime's "
                    "terms, 'command', that layout as the planned family's example's command line, and "
                    "'miniature', the same on the family's tiny preset and a few local processes: "
                    "examples/deepseek_v3_repro.py for DeepSeek-V3, examples/train_family.py --family for the "
                    "others): today it runs recompute none, selective and full, dp_mode "
                    "allreduce (--zero 0), zero1 (--zero 1) or fsdp (--zero 3, without expert parallelism or "
                    "weights tied across stages), tp 1 (--tp sizes are estimated, Megatron-style with sequence "
                    "parallelism, and marked). Unrunnable ones are marked, not hidden, unless --runnable-only.")
    p.add_argument("--model", required=True, help="deepseek-v3; a family preset whose saved bytes come from its "
                   f"modules' declarations ({', '.join(planner_names())}); a family's Hugging Face config.json as "
                   "shipped (the file or its folder; its model_type picks the family, keys that do not shape the "
                   "cost are ignored and named); or a model JSON in SimuMax's layout (Megatron and Hugging Face names "
                   "such as ffn_hidden_size or num_hidden_layers are read too; an unknown key is an error)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--system", default="h800", help="h800, h100, a100 or a SimuMax system JSON (default h800)")
    p.add_argument("--gpu-memory", default=None, help="GPU memory, e.g. 80GB (overrides the system)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="dense BF16 TFLOPS per GPU (FP8: twice that)")
    p.add_argument("--net-gbps", type=float, default=None, help="inter-node bandwidth per GPU in Gbit/s (e.g. 400)")
    p.add_argument("--nvlink-gbs", type=float, default=None, help="intra-node bandwidth per GPU in GB/s")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default from the system: 8)")
    p.add_argument("--strategy", default=None, help="SimuMax strategy JSON: fixes pp_size, ep_size, "
                   "micro_batch_size, seq_len, zero_state, dtype, enable_recompute where given")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the model's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's or 4096)")
    p.add_argument("--mbs", type=_int_list, default=None, help="micro-batch sizes to try, e.g. 1,2 (default 1)")
    p.add_argument("--pp", type=_int_list, default=None, help="pipeline sizes to try (default: divisors <= 32)")
    p.add_argument("--ep", type=_int_list, default=None, help="expert-parallel sizes to try (default: all valid)")
    p.add_argument("--tp", type=_int_list, default=None, help="tensor-parallel sizes to try (default 1; Megatron-style "
                   "with sequence parallelism; estimated, marked not runnable where the runtime cannot launch them)")
    p.add_argument("--schedules", default=None, help="schedules to try, comma-separated (default: all hand ones)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default=None, help="GEMM / activation precision")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="selective",
                   help="activation recompute to model (default selective, DeepSeek-V3's; the runtime applies each "
                        "policy to every family's stages)")
    p.add_argument("--runnable-only", action="store_true",
                   help="rank only configurations the runtime can launch (default: rank all, mark the others)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=1,
                   help="ZeRO stage: 0 all-reduce, 1 optimizer state sharded (zero1), 3 fully_shard (fsdp); default 1")
    p.add_argument("--auto", type=int, default=0, metavar="N", help="also search the auto schedule for the N best "
                   "layouts (a few seconds each)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the ranking as JSON to this path")
    p.add_argument("--keep-pp", action="store_true",
                   help="print the miniature (the family's example's command for the best runnable layout) at that "
                        "layout's own pp, one local process per pipeline rank, the family's tiny preset given the "
                        "fewest --layers that put a block on every stage, at small sizes (--vocab-size 128 "
                        "--seq-len 16 --micro-batch-size 1 --steps 20: DeepSeek-V3 at pp 16 takes about 4 minutes "
                        "on 2 cores); default: pp 2, at most 4 processes, the example's own sizes")
    p.add_argument("--memory-savers", default="auto",
                   help="the planned family's activation savers to count, as its config's memory_savers "
                        "(layers/savers.py): 'auto' (default: none, or all of them when nothing fits without them on "
                        "a model whose modules have them), 'all' (the family's), 'none' or a comma-separated subset "
                        "of the family's: "
                        + "; ".join(f"{f.title} {', '.join(f.savers)}" for f in planned_families().values())
                        + " (models/registry.py)")
    p.set_defaults(func=cmd_plan)


def _system(args: argparse.Namespace):
    system = load_system(args.system)
    changes: dict = {}
    if args.gpu_memory is not None:
        changes["gpu_memory_gb"] = parse_size_gb(args.gpu_memory)
    if args.gpu_tflops is not None:
        if args.gpu_tflops <= 0:
            raise ScheduleError(f"--gpu-tflops must be positive, got {args.gpu_tflops}")
        changes["tflops_bf16"] = args.gpu_tflops
        changes["tflops_fp8"] = 2 * args.gpu_tflops
    if args.net_gbps is not None:
        if args.net_gbps <= 0:
            raise ScheduleError(f"--net-gbps must be positive, got {args.net_gbps}")
        changes["inter_gbs"] = args.net_gbps / 8
    if args.nvlink_gbs is not None:
        changes["intra_gbs"] = args.nvlink_gbs
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    return system.replace(**changes)


def strategy_options(path: str | None) -> dict:
    """Options fixed by a SimuMax strategy JSON (only the keys it gives)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ScheduleError(f"cannot read strategy JSON {path!r}: {exc}") from exc
    out: dict = {}
    if "tp_size" in data:
        tp = int(data["tp_size"])
        if tp < 1:
            raise ScheduleError(f"strategy JSON {path!r}: tp_size must be >= 1, got {data['tp_size']}")
        out["tp"] = [tp]
    if "pp_size" in data:
        out["pp"] = [int(data["pp_size"])]
    if "ep_size" in data:
        out["ep"] = [int(data["ep_size"])]
    if "micro_batch_size" in data:
        out["micro_batch_sizes"] = (int(data["micro_batch_size"]),)
    if "seq_len" in data:
        out["seq_len"] = int(data["seq_len"])
    if "zero_state" in data:
        try:
            out["zero"] = zero_from_config(data["zero_state"])
        except ValueError as exc:
            raise ScheduleError(f"strategy JSON {path!r}: {exc}") from None
    if data.get("dtype") in ("bf16", "fp8"):
        out["dtype"] = data["dtype"]
    if "enable_recompute" in data:
        out["recompute"] = "selective" if data["enable_recompute"] else "none"
    return out


def with_commands(data: dict, family: PlannedFamily, keep_pp: bool = False) -> dict:
    """The plan's JSON with ``"command"`` next to every configuration's ``"launch"``: the planned ``family``'s
    example's command line for a runnable one (``planner.runnable.demo_command``), None for one the runtime
    cannot launch; ``"miniature"``, the command of its miniature (at its own pp with ``keep_pp``); and, where
    the example cannot take the layout, ``"no_miniature"``: why (``runnable.command_refusal``)."""
    entries = data["configurations"] + data["over_memory"] + ([data["reference"]] if data.get("reference") else [])
    for entry in entries:
        runnable = entry["runnable"]
        small = miniature(entry["launch"], family, keep_pp=keep_pp)
        entry["command"] = demo_command(entry["launch"], family) if runnable else None
        entry["miniature"] = demo_command(small, family) if runnable else None
        refusal = command_refusal(small, family) if runnable else None
        if refusal:
            entry["no_miniature"] = refusal
    return data


def best_command(result, keep_pp: bool = False) -> str | None:
    """The fastest runnable configuration that fits, as a line: its launch tuple and the command of its
    miniature (``runnable.miniature``: the same program on the planned family's tiny preset and a few local
    processes, or with ``keep_pp`` one process per pipeline rank of the layout, the model deepened to fill its
    stages), or why there is none (``runnable.command_refusal``)."""
    family = family_of(result.model)
    for est in result.ranked:
        if not est.runnable:
            continue
        full = launch(est.strategy, result.memory_savers)
        small = miniature(full, family, keep_pp=keep_pp)
        lead = (f"the best runnable layout launches as pp {full['pp']} x dp {full['dp']} x ep {full['ep']} "
                f"({full['schedule']}, {full['dp_mode']}, recompute {full['recompute']}, {full['microbatches']} "
                f"micro-batches of {full['micro_batch_size']})")
        refusal = command_refusal(small, family)
        if refusal:
            return f"{lead}; no miniature: {refusal}"
        layers = f", {small['layers']} layers" if small.get("layers") else ""
        return (f"{lead}; the same program in miniature (tiny {family.title}{layers}, pp {small['pp']} x dp "
                f"{small['dp']} x ep {small['ep']} local gloo processes):\n  {demo_command(small, family)}")
    return None


def planned_with_savers(model: ModelSpec, savers: str, planned: Callable[[str], PlanResult]
                        ) -> tuple[PlanResult, str]:
    """The plan with the savers asked for; with ``"auto"``, without savers unless nothing fits that way and
    the model's modules have savers (a family whose modules declare what they keep, or MLA: DeepSeek-V3's
    modules), then with all of the family's, and a line saying so (empty when nothing was switched on)."""
    if savers != "auto":
        return planned(savers), ""
    plain = planned("none")
    if plain.ranked or (model.attention_type != "mla" and model.declared_saved is None):
        return plain, ""
    saved = planned("all")
    if not saved.ranked:
        return plain, ""
    family = family_of(model)
    return saved, (f"nothing fits without the activation savers ({family.owner}: {', '.join(family.savers)}; "
                   "options of the shared modules, all in the runtime): planned with all of them on "
                   "(--memory-savers none plans without them, a list picks some)")


def result_savers(asked: str) -> str:
    """The savers a follow-up plan counts: those asked for, none for ``"auto"``."""
    return asked if asked != "auto" else "none"


def full_recompute_hint(recompute: str, full: PlanResult) -> str:
    """What a plan where nothing fits under ``recompute`` would give under full recompute (``full``)."""
    if not full.ranked:
        return f"nothing fits with recompute {recompute}, nor with --recompute full"
    best = full.ranked[0].strategy
    return (f"nothing fits with recompute {recompute}; with --recompute full {len(full.ranked)} configurations fit, "
            f"the best pp {best.pp} x dp {best.dp} x ep {best.ep} ({best.schedule}, "
            f"{full.ranked[0].memory_gb['total']:.1f} GB)")


def cmd_plan(args: argparse.Namespace) -> int:
    described = planner_model(args.model)
    model = described.spec if described is not None else ModelSpec.load(args.model)
    if described is not None and described.note:
        print(described.note)
    family = family_of(model)
    family.memory_savers(args.memory_savers)  # a saver the family's modules lack fails before any estimate
    system = _system(args)
    options = strategy_options(args.strategy)
    if args.pp:
        options["pp"] = args.pp
    if args.ep:
        options["ep"] = args.ep
    if args.tp:
        options["tp"] = args.tp
    if args.mbs:
        options["micro_batch_sizes"] = tuple(args.mbs)
    if args.seq_len:
        options["seq_len"] = args.seq_len
    if args.dtype:
        options["dtype"] = args.dtype
    options.setdefault("recompute", args.recompute)
    options.setdefault("zero", args.zero)
    if args.schedules:
        options["schedules"] = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    if args.auto < 0:
        raise ScheduleError(f"--auto must be >= 0, got {args.auto}")
    def planned(savers: str, **changes):
        # a family's model counts its savers from its modules, built with them on; the formulas read the switch
        savers = family.memory_savers(savers)  # "all": the family's own
        spec = model if described is None else planner_model(args.model, savers).spec
        with memory_savers(savers):
            return plan(spec, system, args.gpus, args.global_batch, auto_top=args.auto,
                        runnable_only=args.runnable_only, **{**options, **changes})

    result, note = planned_with_savers(model, args.memory_savers, planned)
    if note:
        print(note)
    if not result.ranked and options["recompute"] != "full":
        print(full_recompute_hint(options["recompute"], planned(result_savers(args.memory_savers), recompute="full")))
    print_plan(result, args.top)
    command = best_command(result, args.keep_pp)
    if command:
        print(command)
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(with_commands(result.to_dict(max(args.top, 20)), family, args.keep_pp), fh, indent=2)
            fh.write("\n")
    return 0 if result.ranked else 1
