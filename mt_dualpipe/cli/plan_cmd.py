"""``mt-dualpipe plan``: rank parallel strategies for a model on a modelled cluster (nothing is launched)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from ..models.planner_specs import planner_model, planner_names
from ..planner import ModelSpec, plan
from ..planner.activations import memory_savers
from ..planner.report import print_plan
from ..planner.runnable import ZERO_STAGES, demo_command, launch, miniature, zero_from_config
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
                    "terms, and 'command', a command line running that layout in miniature in "
                    "examples/deepseek_v3_repro.py): today it runs recompute none, selective and full, dp_mode "
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
                        "policy to DeepSeek-V3 and Llama stages)")
    p.add_argument("--runnable-only", action="store_true",
                   help="rank only configurations the runtime can launch (default: rank all, mark the others)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=1,
                   help="ZeRO stage: 0 all-reduce, 1 optimizer state sharded (zero1), 3 fully_shard (fsdp); default 1")
    p.add_argument("--auto", type=int, default=0, metavar="N", help="also search the auto schedule for the N best "
                   "layouts (a few seconds each)")
    p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the ranking as JSON to this path")
    p.add_argument("--keep-pp", action="store_true",
                   help="print the miniature (the demo's command for the best runnable layout) at that layout's own "
                        "pp, one local process per pipeline rank, the tiny DeepSeek-V3 given the fewest --layers "
                        "that put a block on every stage, at small sizes (--vocab-size 128 --seq-len 16 "
                        "--micro-batch-size 1 --steps 20: pp 16 takes about 4 minutes on 2 cores); default: pp 2, "
                        "at most 4 processes, the demo's own sizes")
    p.add_argument("--memory-savers", default="auto",
                   help="DeepSeek-V3's activation savers to count, as the runtime's DeepSeekV3Config.memory_savers: "
                        "'auto' (default: none, or all of them when nothing fits without them on a model whose "
                        "modules have them), 'all', 'none' or a comma-separated subset of norm, swiglu, combine, "
                        "router, attention, loss, mla_input (planner/activations.py)")
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


def with_commands(data: dict, keep_pp: bool = False) -> dict:
    """The plan's JSON with ``"command"`` next to every configuration's ``"launch"``: the demo's command line
    for a runnable one (``planner.runnable.demo_command``), None for one the runtime cannot launch; and
    ``"miniature"``, the command of its miniature (at its own pp with ``keep_pp``)."""
    entries = data["configurations"] + data["over_memory"] + ([data["reference"]] if data.get("reference") else [])
    for entry in entries:
        entry["command"] = demo_command(entry["launch"]) if entry["runnable"] else None
        entry["miniature"] = demo_command(miniature(entry["launch"], keep_pp=keep_pp)) if entry["runnable"] else None
    return data


def best_command(result, keep_pp: bool = False) -> str | None:
    """The fastest runnable configuration that fits, as a line: its launch tuple and the demo's command for its
    miniature (``runnable.miniature``: the same program on the tiny DeepSeek-V3 and a few local processes, or
    with ``keep_pp`` one process per pipeline rank of the layout, the model deepened to fill its stages)."""
    for est in result.ranked:
        if not est.runnable:
            continue
        full = launch(est.strategy, result.memory_savers)
        small = miniature(full, keep_pp=keep_pp)
        command = demo_command(small)
        if command is None:
            return None
        layers = f", {small['layers']} layers" if small.get("layers") else ""
        return (f"the best runnable layout launches as pp {full['pp']} x dp {full['dp']} x ep {full['ep']} "
                f"({full['schedule']}, {full['dp_mode']}, recompute {full['recompute']}, {full['microbatches']} "
                f"micro-batches of {full['micro_batch_size']}); the same program in miniature (tiny DeepSeek-V3"
                f"{layers}, pp {small['pp']} x dp {small['dp']} x ep {small['ep']} local gloo processes):\n  {command}")
    return None


def planned_with_savers(model: ModelSpec, savers: str, planned: Callable[[str], PlanResult]
                        ) -> tuple[PlanResult, str]:
    """The plan with the savers asked for; with ``"auto"``, without savers unless nothing fits that way and
    the model's modules have DeepSeek-V3's savers (MLA: ``models/deepseek_v3``, the only modules the
    switches exist in), then with all of them, and a line saying so (empty when nothing was switched on)."""
    if savers != "auto":
        return planned(savers), ""
    plain = planned("none")
    if plain.ranked or (model.attention_type != "mla" and model.declared_saved is None):
        return plain, ""
    saved = planned("all")
    if not saved.ranked:
        return plain, ""
    return saved, ("nothing fits without the activation savers (DeepSeek-V3's report's, options of the shared modules, "
                   "all in the runtime): planned with all of them on (--memory-savers none plans without them, a "
                   "list picks some)")


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
    family = planner_model(args.model)
    model = family.spec if family is not None else ModelSpec.load(args.model)
    if family is not None and family.note:
        print(family.note)
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
        spec = model if family is None else planner_model(args.model, savers).spec
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
            json.dump(with_commands(result.to_dict(max(args.top, 20)), args.keep_pp), fh, indent=2)
            fh.write("\n")
    return 0 if result.ranked else 1
