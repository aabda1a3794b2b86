"""Train DeepSeek-V3 (tiny preset) with DualPipe on local CPU processes — the README's first command.

    python examples/deepseek_v3_repro.py                      # 2 ranks, DualPipe, 50 steps, about a minute
    python examples/deepseek_v3_repro.py --corpus docs/ --tokenizer tokenizer.json   # real text, held-out loss
    python examples/deepseek_v3_repro.py --save-pretrained ckpt/ && \
        python examples/deepseek_v3_repro.py --from-pretrained ckpt/ --schedule zbv   # fine-tune a checkpoint
    python examples/deepseek_v3_repro.py --inject-nan 25      # watch a NaN get caught and rewound
    python examples/deepseek_v3_repro.py --pp 2 --ep 2 --inject-error 5 --timeout 10   # an exception, rewound
    python examples/deepseek_v3_repro.py --checkpoint-dir ckpt/   # async checkpoints; rerun to resume
    python examples/deepseek_v3_repro.py --schedule dualpipev --pp 2 --steps 20 --summary out.json
    torchrun --nproc-per-node 4 examples/deepseek_v3_repro.py --schedule zbv
    python examples/deepseek_v3_repro.py --pp 2 --ep 2          # + expert parallelism: 4 processes
    python examples/deepseek_v3_repro.py --pp 2 --dp 2 --ep 2 --dp-mode zero1   # DeepSeek-V3's layout, 8 processes
    python examples/deepseek_v3_repro.py --pp 8 --layers 14 --schedule zbv --vocab-size 128 --micro-batch-size 1 \
        --seq-len 16 --steps 20        # pp 8 in miniature: a block on each of ZB-V's 16 stages, about a minute

It spawns ``--pp`` x ``--dp`` x ``--ep`` processes itself (gloo on 127.0.0.1), or runs as one of them
under torchrun, on one ``mt_dualpipe.parallel.init_parallel(pp, dp, ep)`` mesh (pp outermost).
There are dp x ep data-parallel pipelines; the ep ranks at the same (pp, dp) position shard that
stage's routed experts and exchange tokens by all-to-all (overlapped with the other micro-batch's
compute inside DualPipe's F&B units). The pipeline (``Pipeline(mesh=...)``) reduces each stage's
gradients right after its last W: dense weights over dp x ep (and DualPipe's mirrored copy and the
MTP's tied embedding copy in the same pass), routed experts over dp; ``--dp-mode zero1`` shards the
AdamW state over those groups (``pipe.build_optimizer``). ``mt-dualpipe plan --json`` prints the same
knobs (``--pp --dp --ep --dp-mode --schedule --microbatches --recompute``) as a ready command line.
Each rank builds the same seeded model (or reads only its own stages' tensors from a Hugging Face
checkpoint, ``--from-pretrained``), keeps only its stages, and trains with AdamW on a synthetic task,
or on local text (``--corpus FILES|DIR``: streamed, packed into sequences, every ``--val-every``-th
held out; UTF-8 bytes or ``--tokenizer tokenizer.json``). The default layout balances a modelled
cost per rank, then per stage (embedding, head, MTP and losses included); it is printed per stage.
A deeper pipeline needs a deeper model: ``--layers N`` sets the preset's block count, and a run whose
cut would leave a stage between the first (embedding) and the last (head, MTP, losses) without a block
is refused before any process starts, naming the stage, the model's layer count, the deepest pp it
fills and the ``--layers`` that fills this one (``mt_dualpipe.planner.stage_fill``; the tiny preset's
4 layers fill DualPipe up to pp 6 and ZB-V / DualPipeV, two stages per rank, up to pp 3).
Every step runs under
``mt_dualpipe.resilience.Rewind``: a NaN/inf or an exception on any rank is agreed on by all ranks,
which go back to the last snapshot (every ``--snapshot-every`` steps) and skip the batch. Every
point-to-point and expert all-to-all wait is bounded by ``--timeout`` seconds, so a rank whose partner
failed mid-step stops waiting and joins the agreement; after an exception every rank rebuilds its
pipeline (and, with ``--ep`` > 1, the expert-parallel groups) on fresh process groups.
A rich progress bar shows the loss, the MTP loss, the expert-load balance (max violation:
max load / mean load − 1), tokens/s and the rewinds; the last step is timed per instruction, and
the summary compares its measured bubble rate with the simulator's for the same schedule, driven by
that step's own per-stage, per-op-kind costs and hop latency, and says what the rest is (see
``mt_dualpipe.visualize.measured``). With ``--corpus`` it reports the held-out loss before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # the ranks' fork server imports torch beside this process, not after it
    from mt_dualpipe.parallel.local_ranks import start_rank_server

    start_rank_server()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mt_dualpipe.data.text import PackedText, load_tokenizer  # noqa: E402
from mt_dualpipe.layers.expert_parallel import fresh_mesh_group  # noqa: E402
from mt_dualpipe.layers.moe_state import (  # noqa: E402
    max_violation,
    moe_layers,
    set_ep_group,
    set_timeout,
    update_expert_bias,
)
from mt_dualpipe.layers.savers import MEMORY_SAVERS  # noqa: E402
from mt_dualpipe.models.deepseek_v3 import (  # noqa: E402
    DeepSeekV3Config,
    DeepSeekV3Model,
    criterion_for,
    parse_layout,
    stages_for_rank,
    sync_expert_load,
)
from mt_dualpipe.models.deepseek_v3.data import synthetic_batch  # noqa: E402
from mt_dualpipe.models.deepseek_v3.stage_balance import (  # noqa: E402
    LayoutCost,
    balance,
    layout_cost,
    piece_costs,
    stage_weights,
)
from mt_dualpipe.parallel.local_ranks import local_init_method, spawn_local_ranks  # noqa: E402
from mt_dualpipe.parallel.stage_sync import DP_MODES  # noqa: E402
from mt_dualpipe.resilience import FaultInjector, Rewind, StepResult, rebuild_pipeline  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", "--ranks", dest="pp", type=int, default=2,
                   help="pipeline ranks, default 2 (--ranks is the older name)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of the whole model, experts included (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: each pipeline rank's routed experts are sharded over --ep ranks,\n"
                        "which also run different data (a second data-parallel axis for the dense weights);\n"
                        "--pp x --dp x --ep processes in all (default 1)")
    p.add_argument("--dp-mode", default="allreduce", choices=list(DP_MODES),
                   help="how the data-parallel gradient sync runs: allreduce (every rank keeps the full AdamW\n"
                        "state) or zero1 (reduce-scatter, AdamW state sharded over the replicas), default allreduce;\n"
                        "fsdp is refused for DeepSeek-V3 (experts and dense weights reduce over different groups)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps, default 50 (about a minute on 2 cores)")
    p.add_argument("--schedule", default="dualpipe", help="dualpipe (default), dualpipev, or any registered schedule")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default 2 x stages)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="stages per rank of interleaved-1f1b (its default: 2)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences per micro-batch, default 4 (or --global-batch / (dp x ep x micro-batches))")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step over all replicas; must split into dp x ep replicas x\n"
                        "micro-batches (default: micro-batch size x micro-batches x dp x ep)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence, default 64")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate, default 3e-3")
    p.add_argument("--preset", default="tiny", help="model preset, default tiny")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="transformer blocks of the model (the preset's n_layers; tiny: 4). Every stage between the\n"
                        "first and the last needs one: DualPipe at pp 8 takes 6 or more, ZB-V and DualPipeV at\n"
                        "pp 8 take 14 (a run that would leave a stage empty says how many it needs)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="vocabulary of the synthetic task (the preset's vocab_size; tiny: 1024). A small one (128)\n"
                        "lets a deep, narrow run's loss fall within a few steps of a few tokens each")
    p.add_argument("--layout", default=None,
                   help="stage layout, e.g. 'Et*2|t*2mL' (default: balanced by modelled cost per rank, then stage)")
    p.add_argument("--corpus", nargs="+", default=None, metavar="FILE|DIR",
                   help="train on local text (files and/or folders, streamed and packed) instead of the synthetic\n"
                        "task; every --val-every-th packed sequence is held out for the validation loss")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer.json (or a folder with one), read with the tokenizers library; the model's\n"
                        "vocabulary becomes the tokenizer's (default with --corpus: UTF-8 bytes)")
    p.add_argument("--val-every", type=int, default=20, metavar="K",
                   help="with --corpus: hold out every K-th packed sequence, default 20")
    p.add_argument("--val-batches", type=int, default=2, metavar="N",
                   help="with --corpus: held-out batches the validation loss averages, before and after training\n"
                        "(default 2; 0: no validation)")
    p.add_argument("--fp8", action="store_true", help="FP8 linears (mt_dualpipe.fp8)")
    p.add_argument("--balance", default=None, metavar="NAME",
                   help="expert-balancing strategy (mt_dualpipe.layers.balance.STRATEGIES: aux_free, seq_aux, "
                        "batch_aux, device_limited, capacity, none); default: the config's (aux_free)")
    p.add_argument("--fp8-dispatch", action="store_true", help="send the MoE dispatch all-to-all in FP8")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recompute policy of the stages (mt_dualpipe.models.recompute), default none")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=("inductor", "aot_eager"),
                   help="torch.compile each block's memory-bound parts, linears kept eager so W keeps their\n"
                        "weight GEMMs (mt_dualpipe.models.compile); backend default inductor")
    p.add_argument("--memory-savers", default="none", metavar="NAMES",
                   help="DeepSeek-V3's activation savers (DeepSeekV3Config.memory_savers): 'all', 'none' (default)\n"
                        "or a comma-separated subset of norm, swiglu, combine, router, attention, loss, mla_input;\n"
                        "the summary puts the planner's peak for the same savers next to the recorded one")
    p.add_argument("--core-attention", default="eager", choices=("eager", "flash"),
                   help="MLA's core attention (DeepSeekV3Config.core_attention): eager (keeps the S x S\n"
                        "probabilities) or flash (q, k, v, output and one log-sum-exp per head: the planner's 'fused')")
    p.add_argument("--bf16-moments", action="store_true", help="AdamW moments in BF16 (mt_dualpipe.optim.AdamWBF16)")
    p.add_argument("--cpu-ema", type=float, default=None, metavar="DECAY",
                   help="keep a parameter EMA with this decay on the CPU, updated in the background after each step")
    p.add_argument("--from-pretrained", default=None, metavar="PATH",
                   help="start from a Hugging Face-layout checkpoint folder (config.json, safetensors, index):\n"
                        "each rank reads only its own stages' tensors; --preset is then ignored")
    p.add_argument("--save-pretrained", default=None, metavar="PATH",
                   help="at the end, write the trained model there as a Hugging Face-layout checkpoint\n"
                        "(every pipeline rank writes its own stages' tensors; one index)")
    p.add_argument("--no-rewind", action="store_true", help="plain loop: no fault checks, snapshots or rewinds")
    p.add_argument("--snapshot-every", type=int, default=10, metavar="N",
                   help="in-memory snapshot (rewind target) every N steps, default 10")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="also write each snapshot there as an async checkpoint; a rerun resumes from the newest")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="demo: NaN in the forward output of the last rank at step STEP (0-based); Rewind\n"
                        "catches it, rewinds to the last snapshot and skips that batch")
    p.add_argument("--inject-error", type=int, default=None, metavar="STEP",
                   help="demo: an exception in the forward of the last rank's first module at step STEP\n"
                        "(0-based); the other ranks stop waiting for it after --timeout seconds, then every\n"
                        "rank rebuilds its communication, rewinds to the last snapshot and skips that batch")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="bound of every pipeline point-to-point and expert all-to-all wait, default 300")
    p.add_argument("--summary", default=None, help="write the run summary as JSON here")
    p.add_argument("--timeline", default=None, help="save the last step's measured timeline JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the progress bar")
    args = p.parse_args(argv)
    if min(args.pp, args.dp, args.ep, args.steps) < 1:
        p.error(f"--pp, --dp, --ep and --steps must be >= 1, got {args.pp}, {args.dp}, {args.ep} and {args.steps}")
    check_mesh_args(args, p.error)
    if args.snapshot_every < 1:
        p.error(f"--snapshot-every must be >= 1, got {args.snapshot_every}")
    if args.inject_nan is not None:
        if args.no_rewind:
            p.error("--inject-nan demonstrates Rewind; drop --no-rewind")
        if not 0 <= args.inject_nan < args.steps:
            p.error(f"--inject-nan STEP must be a step of this run, 0..{args.steps - 1}, got {args.inject_nan}")
    if args.inject_error is not None:
        if args.no_rewind:
            p.error("--inject-error demonstrates Rewind; drop --no-rewind")
        if not 0 <= args.inject_error < args.steps:
            p.error(f"--inject-error STEP must be a step of this run, 0..{args.steps - 1}, got {args.inject_error}")
    if not args.timeout > 0:
        p.error(f"--timeout must be positive, got {args.timeout:g}")
    if args.checkpoint_dir and args.no_rewind:
        p.error("--checkpoint-dir is written by Rewind; drop --no-rewind")
    if args.tokenizer and not args.corpus:
        p.error("--tokenizer needs --corpus (the text it tokenizes)")
    if args.val_every < 2 or args.val_batches < 0:
        p.error(f"--val-every must be >= 2 and --val-batches >= 0, got {args.val_every} and {args.val_batches}")
    return args


def check_mesh_args(args: argparse.Namespace, error) -> None:
    """The mesh and batch knobs: pp from torchrun's world size, the data-parallel mode, the schedule's
    options, and a global batch that splits into dp x ep replicas x micro-batches (sets
    ``args.micro_batch_size``, ``args.global_batch``, ``args.replicas``, ``args.ranks``)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: the world size fixes pp
        world = int(os.environ["WORLD_SIZE"])
        if world % (args.dp * args.ep):
            error(f"torchrun started {world} processes, not a multiple of --dp x --ep = {args.dp} x {args.ep}")
        args.pp = world // (args.dp * args.ep)
    args.ranks = args.pp  # the older name, kept in the summary
    if DP_MODES[args.dp_mode].needs_fully_shard:
        able = " or ".join(m for m, spec in DP_MODES.items() if not spec.needs_fully_shard)
        error(f"--dp-mode {args.dp_mode} is not supported for DeepSeek-V3 stages: routed experts reduce over dp and "
              f"the other weights over dp x ep, which one fully_shard mesh cannot express; use {able}")
    if args.virtual_stages is not None and args.schedule != "interleaved-1f1b":
        error(f"--virtual-stages is an option of interleaved-1f1b, not of {args.schedule!r}")
    if args.from_pretrained and (args.layers, args.vocab_size) != (None, None):
        error("--layers and --vocab-size set a preset's shape; --from-pretrained takes the checkpoint's (its "
              "config.json)")
    if args.corpus and args.vocab_size is not None:
        error("--vocab-size sets the synthetic task's vocabulary; with --corpus it is the tokenizer's (bytes: 256)")
    if not args.from_pretrained:  # a checkpoint's expert count is checked when its stages are built
        try:
            experts = DeepSeekV3Config.preset(args.preset, **preset_overrides(args)).n_routed_experts
        except ValueError as exc:
            flags = {"n_layers": "--layers", "vocab_size": "--vocab-size"}
            error(str(exc) + "".join(f" ({flags[k]} sets {k})" for k in preset_overrides(args) if k in str(exc)))
        if experts % args.ep:
            error(f"--ep {args.ep} does not divide the {experts} routed experts of the {args.preset!r} preset: "
                  f"use an --ep that divides {experts}")
    args.replicas = args.dp * args.ep
    mbs = args.microbatches or default_microbatches(args.schedule, args.pp)
    if args.global_batch is None:
        args.micro_batch_size = args.micro_batch_size or 4
        args.global_batch = args.micro_batch_size * mbs * args.replicas
        return
    share = args.replicas * mbs
    if args.global_batch < 1 or args.global_batch % share:
        error(f"--global-batch {args.global_batch} does not split over dp x ep = {args.dp} x {args.ep} = "
              f"{args.replicas} replicas x {mbs} micro-batches: use a positive multiple of {share}")
    if args.micro_batch_size not in (None, args.global_batch // share):
        error(f"--micro-batch-size {args.micro_batch_size} disagrees with --global-batch {args.global_batch} = "
              f"{args.replicas} replicas x {mbs} micro-batches x {args.global_batch // share}; give one of them")
    args.micro_batch_size = args.global_batch // share


def preset_overrides(args: argparse.Namespace) -> dict:
    """The preset fields the command line sets (``--layers``: ``n_layers``, ``--vocab-size``: ``vocab_size``)."""
    given = {"n_layers": args.layers, "vocab_size": args.vocab_size}
    return {k: v for k, v in given.items() if v is not None}


def default_microbatches(schedule: str, pp: int) -> int:
    """Two micro-batches per stage of a chain (DualPipe: per rank, as its two chains share them)."""
    stages_per_rank = 2 if schedule in ("dualpipev", "zbv", "interleaved-1f1b") else 1
    return 2 * pp * stages_per_rank


# ----- one rank: model, pipeline, optimizer -----------------------------------------------------------
@dataclass
class RankSetup:
    """What one rank trains: its stage modules, the pipeline over them, the optimizer."""

    config: DeepSeekV3Config
    schedule: Any
    mods: list
    pipe: Any
    opt: Any                  # pipe.build_optimizer(...): plain AdamW (allreduce) or its ZeRO-1 shards
    pp_rank: int
    fp8_backend: str | None   # backend_summary(): the one line saying which FP8 GEMM runs
    fp8_gemm: str | None      # its name: "scaled_mm" or "emulated"
    split: LayoutCost         # the layout (blocks per stage) and its modelled stage / rank loads
    data: PackedText | None   # --corpus: the packed, split text; None: the synthetic task
    dims: Any                 # the pp x dp x ep mesh (mt_dualpipe.parallel.ParallelDims)
    last_balance: float = 0.0  # expert-load max violation of the last good step (set by the grad hook)

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica among the dp x ep ones: which share of the global batch it trains on."""
        return self.dims.coord("dp") * self.dims.ep + self.dims.coord("ep")


def setup(args: argparse.Namespace, rank: int, world: int) -> RankSetup:
    """This rank's mesh, pipeline, stage modules, schedule and optimizer."""
    from mt_dualpipe.parallel import init_parallel
    from mt_dualpipe.schedules.registry import build_schedule

    if world != args.pp * args.dp * args.ep:
        raise SystemExit(f"{world} processes but --pp {args.pp} x --dp {args.dp} x --ep {args.ep} = "
                         f"{args.pp * args.dp * args.ep}")
    dims = init_parallel(pp=args.pp, dp=args.dp, ep=args.ep)  # the experts shard over dims.group("ep")
    pp_rank, world = dims.coord("pp"), args.pp

    tokenizer = load_tokenizer(args.tokenizer) if args.corpus else None
    config = model_config(args, tokenizer)
    if args.balance:
        config = config.with_balance(args.balance)
    if args.fp8_dispatch:
        config = config.replace(fp8_dispatch=True)
    config = config.replace(memory_savers=args.memory_savers, core_attention=args.core_attention)
    mbs = args.microbatches or default_microbatches(args.schedule, world)
    options = {} if args.virtual_stages is None else {"virtual_stages": args.virtual_stages}
    sched = build_schedule(args.schedule, world, mbs, **options)
    split = stage_split(config, sched, args.layout, args.seq_len)
    data = None
    if tokenizer is not None:
        data = PackedText(args.corpus, args.seq_len, args.micro_batch_size * sched.num_microbatches,
                          tokenizer=tokenizer, val_every=args.val_every, seed=args.seed)
    if args.from_pretrained:  # only this rank's stages' tensors are read (and, with --ep, only its experts)
        mods = stages_for_rank(config, sched, pp_rank, list(split.counts), checkpoint=args.from_pretrained,
                               mesh=dims, fp8=args.fp8, recompute=args.recompute, compile=args.compile or False)
    else:
        torch.manual_seed(args.seed)
        full = DeepSeekV3Model(config)  # every rank builds the same weights, then keeps its stages
        mods = stages_for_rank(config, sched, pp_rank, list(split.counts), source=full, mesh=dims,
                               recompute=args.recompute, compile=args.compile or False)
        del full
    fp8_backend = fp8_gemm = None
    if args.fp8:
        try:
            from mt_dualpipe.fp8 import backend_summary, convert_to_fp8, resolve_gemm
        except ImportError as exc:
            raise SystemExit(f"--fp8 needs mt_dualpipe.fp8, which is not available here ({exc})") from exc
        if not args.from_pretrained:  # a checkpoint's stages were converted before loading
            for m in mods:
                convert_to_fp8(m)
        device = next(mods[0].parameters()).device
        fp8_backend, fp8_gemm = backend_summary(device), resolve_gemm(device)[0]
    set_timeout(mods, args.timeout)  # the expert all-to-all waits: the same bound as the p2p ones
    pipe = make_pipeline(args, mods, sched, dims)
    opt = make_optimizer(args, pipe, mods)
    pipe.record_activation_bytes = True  # the runtime's peak of saved-activation bytes per step (--recompute)
    return RankSetup(config, sched, mods, pipe, opt, pp_rank, fp8_backend, fp8_gemm, split, data, dims)


def make_pipeline(args: argparse.Namespace, mods: list, sched: Any, dims: Any) -> Any:
    """The pipeline on the mesh: it runs on the pp group and reduces every stage's gradients after its last W
    (dense over dp x ep, experts over dp, mirrored copies and the tied embedding summed in the same pass).
    Each replica draws its own share of the global batch (``step_batch``), hence ``dp_batch="local"``."""
    from mt_dualpipe import DualPipe, DualPipeV, Pipeline

    mesh = {"mesh": dims, "dp_mode": args.dp_mode, "dp_batch": "local"}
    if args.schedule == "dualpipe":
        return DualPipe(tuple(mods), timeout=args.timeout, **mesh)
    if args.schedule == "dualpipev":
        return DualPipeV(tuple(mods), timeout=args.timeout, **mesh)
    return Pipeline(mods, sched, timeout=args.timeout, **mesh)


def make_optimizer(args: argparse.Namespace, pipe: Any, mods: list) -> PipeOptimizer:
    """AdamW (or AdamWBF16) through ``pipe.build_optimizer``, with --cpu-ema's parameter EMA."""
    from mt_dualpipe.optim import AdamWBF16, CpuEMA

    kind = AdamWBF16 if args.bf16_moments else torch.optim.AdamW
    ema = CpuEMA(torch.nn.ModuleList(mods), decay=args.cpu_ema) if args.cpu_ema is not None else None
    return PipeOptimizer(lambda params: kind(params, lr=args.lr, weight_decay=0.1), pipe, ema)


class PipeOptimizer:
    """The optimizer of the current pipeline: ``pipe.build_optimizer(factory)`` (one object for this rank's
    stages; with --dp-mode zero1 its state is sharded over each weight kind's data-parallel group).

    A ZeRO-1 optimizer steps the shards its pipeline's gradient syncs reduce into, so after ``Rewind``
    rebuilds the pipeline on fresh groups it is built again from the new one (``rebind``); Rewind
    keeps this one object and restores the snapshot's state into it right after the rebuild.
    With a CPU EMA a step waits for the EMA's last read, then hands it the new parameters."""

    def __init__(self, factory: Any, pipe: Any, ema: Any = None):
        self.factory, self.ema = factory, ema
        self.inner = pipe.build_optimizer(factory)

    def rebind(self, pipe: Any) -> None:
        self.inner = pipe.build_optimizer(self.factory)

    def step(self) -> None:
        if self.ema is not None:
            self.ema.wait()
        self.inner.step()
        if self.ema is not None:
            self.ema.update()

    def __getattr__(self, name: str) -> Any:  # zero_grad, state_dict, load_state_dict, state_bytes, param_groups
        return getattr(self.__dict__["inner"], name)


def model_config(args: argparse.Namespace, tokenizer: Any) -> DeepSeekV3Config:
    """The checkpoint's config (--from-pretrained), else the preset sized for the data: bytes need at least
    256 entries, a tokenizer.json exactly its vocabulary."""
    if args.from_pretrained:
        config = DeepSeekV3Config.from_hf(args.from_pretrained)
        need = 0 if tokenizer is None else tokenizer.vocab_size
        if need > config.vocab_size:
            raise SystemExit(f"the tokenizer has {need} tokens but the checkpoint {args.from_pretrained} embeds "
                             f"{config.vocab_size}")
        if args.seq_len > config.max_seq_len:
            raise SystemExit(f"--seq-len {args.seq_len} exceeds the checkpoint's max_position_embeddings "
                             f"{config.max_seq_len}")
        return config
    config = DeepSeekV3Config.preset(args.preset, max_seq_len=max(args.seq_len, 64), **preset_overrides(args))
    if tokenizer is not None:
        config = config.replace(vocab_size=tokenizer.vocab_size if args.tokenizer else max(config.vocab_size, 256))
    return config


def stage_split(config: DeepSeekV3Config, schedule: Any, layout: str | None, seq_len: int) -> LayoutCost:
    """``--layout``, or the layout balanced by modelled cost for this schedule's placement (the heaviest
    rank first, then the heaviest stage: embedding, head, MTP and losses weigh in), with its loads."""
    if layout is None:
        return balance(config, schedule.placement, seq_len)
    counts = parse_layout(config, schedule.num_stages(0), layout)
    return layout_cost(piece_costs(config, seq_len), counts, stage_weights(schedule.placement))


def depth_problem(args: argparse.Namespace) -> str | None:
    """Why the model's layers cannot fill this pipeline, or None when they do: a stage between the first
    (embedding) and the last (head, MTP, losses) that the layout (``--layout``, or the balanced cut the
    ranks will build) leaves without a block, or with ``--recompute`` an embedding-only first stage (the
    stages recompute per stage, and one with no block has nothing to recompute: ``apply_recompute``
    refuses it). The runtime would run an empty stage as a pass-through, but it trains nothing on a
    rank the user asked to fill (and the expert-load sync needs weights on a rank's first stage), so the
    run is refused here, once, before any process starts, naming the stages, the model's layer count,
    the deepest pp it fills and what to pass (``mt_dualpipe.planner.stage_fill``)."""
    from mt_dualpipe.planner.stage_cut import empty_stages
    from mt_dualpipe.planner.stage_fill import placement_of

    config = model_config(args, load_tokenizer(args.tokenizer) if args.corpus else None)
    options = {} if args.virtual_stages is None else {"virtual_stages": args.virtual_stages}
    placement = placement_of(args.schedule, args.pp, options)
    if placement is None:  # a schedule that cannot run here: its own message, once
        from mt_dualpipe.schedules.errors import ScheduleError
        from mt_dualpipe.schedules.registry import build_schedule

        try:
            build_schedule(args.schedule, args.pp, args.microbatches or default_microbatches(args.schedule, args.pp),
                           **options)
        except ScheduleError as exc:
            return f"--schedule {args.schedule} at --pp {args.pp}: {exc}"
        return None
    n = len(placement[0])
    try:
        counts = parse_layout(config, n, args.layout) if args.layout else list(balance(config, placement,
                                                                                       args.seq_len).counts)
    except ValueError as exc:
        return f"--layout: {exc}"
    first = args.recompute != "none"
    empty = empty_stages(counts, first)
    return unfilled_message(args, config, placement, counts, empty, first) if empty else None


def unfilled_message(args: argparse.Namespace, config: DeepSeekV3Config, placement: Any, counts: list[int],
                     empty: list[int], first: bool) -> str:
    """``depth_problem``'s message: the stages left without a block, why that is refused, the model's layer
    count, and what to pass (a fuller ``--layout``; or ``--layers`` and the deepest pp the layers fill)."""
    from mt_dualpipe.planner import ModelSpec
    from mt_dualpipe.planner.stage_fill import deepest_filled_pp, layers_to_fill

    n, layers = len(counts), config.n_layers
    model = (f"The checkpoint {args.from_pretrained}" if args.from_pretrained else f"The {args.preset!r} preset"
             + (f" (--layers {args.layers})" if args.layers is not None else ""))
    named = ", ".join(map(str, empty[:8])) + (f" ... ({len(empty)} of {n})" if len(empty) > 8 else "")
    where = (f"--layout {args.layout}" if args.layout else f"its balanced cut {layout_string(config, n, counts)}")
    why = ["a stage between the first (embedding) and the last (head, MTP, losses) holds no parameter without one"
           ] if empty != [0] else []
    if 0 in empty:
        why.append(f"--recompute {args.recompute} needs one on the first stage too (an embedding-only stage has "
                   "nothing to recompute)")
    head = (f"--pp {args.pp} runs {args.schedule} on {n} stages per chain; {where} leaves stage"
            f"{'s' if len(empty) > 1 else ''} {named} without a layer, and {'; '.join(why)}. {model} has {layers} "
            "layers")
    if args.layout:
        blocks = n - 1 if first else n - 2  # one per stage but the last (and the first without recompute)
        more = f" and --layers {blocks} or more" if layers < blocks else ""
        return f"{head}. Pass a --layout with a block ('t') in each of stages {0 if first else 1}..{n - 2}{more}"
    options = {} if args.virtual_stages is None else {"virtual_stages": args.virtual_stages}
    deepest = deepest_filled_pp(ModelSpec.from_deepseek_config(config), args.schedule, args.seq_len, args.pp, options,
                                first)
    need = None if args.from_pretrained else layers_to_fill(
        lambda k: ModelSpec.from_deepseek_config(config.replace(n_layers=k)), placement, args.seq_len,
        least=layers + 1, first=first)
    fixes = [f"--layers {need} (the fewest that fill pp {args.pp})"] if need is not None else []
    fixes += [f"--pp {deepest}"] if deepest else []
    return (f"{head}; the deepest pp they fill under {args.schedule} is {deepest or 'none'}. Pass "
            + " or ".join(fixes or ["a deeper model"]))


def split_line(config: DeepSeekV3Config, split: LayoutCost) -> str:
    """The per-stage and per-rank split of the modelled cost, in percent of the whole model."""
    names = layout_string(config, len(split.counts), list(split.counts)).split("|")
    stages = " · ".join(f"s{i} {n} {100 * c:.0f} %" for i, (n, c) in enumerate(zip(names, split.stages)))
    ranks = " / ".join(f"{100 * c:.0f} %" for c in split.ranks)
    return f"modelled cost per stage: {stages} · per rank: {ranks}"


def layout_string(config: DeepSeekV3Config, num_stages: int, layout: str | None) -> str:
    """The stage layout in ``--layout`` notation (E embedding, t*N blocks, m MTP, L loss), e.g. 'Et*2|t*2mL'."""
    parts = []
    for i, n in enumerate(parse_layout(config, num_stages, layout)):
        part = ("E" if i == 0 else "") + ("t" if n == 1 else f"t*{n}" if n else "")
        if i == num_stages - 1:
            part += "m" * min(config.mtp_depth, 1) + "L"
        parts.append(part)
    return "|".join(parts)


def start_line(args: argparse.Namespace, run: RankSetup, world: int) -> str:
    """One line saying what runs where (collective: every rank contributes its parameter count)."""
    own = sum(p.numel() for m in run.mods for p in m.parameters())
    counts: list = [None] * world
    dist.all_gather_object(counts, own)
    per_pp = ", ".join(f"{c / 1e6:.2f}M" for c in counts[::args.replicas])  # replica 0 of each pipeline rank
    sched = run.schedule
    ep = mesh_words(args)
    fault = f", NaN injected at step {args.inject_nan}" if args.inject_nan is not None else ""
    fault += f", exception injected at step {args.inject_error}" if args.inject_error is not None else ""
    rewind = "off" if args.no_rewind else f"snapshot every {args.snapshot_every} steps{fault}"
    layout = layout_string(run.config, sched.num_stages(0), list(run.split.counts))
    return (f"{args.schedule} · {args.pp} ranks{ep} · {sched.num_microbatches} micro-batches of "
            f"{args.micro_batch_size}x{args.seq_len} tokens · layout {layout} · "
            f"params/rank {per_pp} · rewind: {rewind}")


def mesh_words(args: argparse.Namespace) -> str:
    """' x dp 2 x ep 2 (zero1)' for the data/expert-parallel part of the mesh ('' without one)."""
    out = (f" x dp {args.dp}" if args.dp > 1 else "") + (f" x ep {args.ep}" if args.ep > 1 else "")
    return out + (f" ({args.dp_mode})" if out and args.dp_mode != "allreduce" else "")


# ----- stepping: Rewind, or the bare loop -------------------------------------------------------------
class PlainSteps:
    """``--no-rewind``: the bare loop behind Rewind's interface (no checks, agreement or snapshots)."""

    checkpoint_mode = None
    resumed_from = None

    def __init__(self, pipeline: Any, optimizer: torch.optim.Optimizer, *, num_chunks: int, criterion: Any,
                 grad_hook: Any):
        self.pipeline, self.optimizer = pipeline, optimizer
        self.num_chunks, self.criterion, self.grad_hook = num_chunks, criterion, grad_hook
        self.step_index = self.position = 0
        self.events: list = []
        self.skipped: set[int] = set()
        self.counters: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def step(self, batch_fn) -> StepResult:
        step, pos = self.step_index, self.position
        batch = batch_fn(pos)
        self.optimizer.zero_grad(set_to_none=True)
        self.pipeline.step(*batch["inputs"], num_chunks=self.num_chunks, criterion=self.criterion,
                           labels=batch["labels"])
        self.grad_hook()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index, self.position = step + 1, pos + 1
        self.counters["steps"] += 1
        return StepResult(step, pos, True, None, 0.0)

    def close(self) -> None:
        pass


def make_stepper(args: argparse.Namespace, run: RankSetup, rank: int, world: int, grad_hook) -> Rewind | PlainSteps:
    """Rewind over the pipeline (collective: it creates its own groups), or PlainSteps with --no-rewind."""
    criterion = criterion_for(run.mods)
    if args.no_rewind:
        return PlainSteps(run.pipe, run.opt, num_chunks=run.schedule.num_microbatches, criterion=criterion,
                          grad_hook=grad_hook)
    faults = None
    if args.inject_nan is not None:
        faults = FaultInjector(rank=rank)
        faults.nan(rank=world - 1, step=args.inject_nan)  # forward output of the last rank's first module
    if args.inject_error is not None:
        faults = faults or FaultInjector(rank=rank)
        faults.raise_in(rank=world - 1, step=args.inject_error)  # InjectedFault after that module's forward
    def rebuild(old):  # every rank creates every pp (and EP) group again, in the same order: on gloo a timed-out
        if args.ep > 1:  # wait closes its pair, and a timed-out all-to-all leaves its EP group out of step
            set_ep_group(run.mods, fresh_mesh_group(run.dims, "ep"))
        new = rebuild_pipeline(old, group=fresh_mesh_group(run.dims, "pp"))
        run.opt.rebind(new)  # Rewind restores the snapshot's optimizer state into it next
        return new

    # sync_mirrored=False: the pipeline's step already summed the mirrored stages' gradients (mesh=)
    return Rewind(run.pipe, run.opt, num_chunks=run.schedule.num_microbatches, criterion=criterion, modules=run.mods,
                  snapshot_every=args.snapshot_every, checkpoint_dir=args.checkpoint_dir, sync_mirrored=False,
                  grad_hook=grad_hook, rebuild=rebuild, faults=faults)


def step_batch(args, run: RankSetup, position: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One data-parallel replica's share of the global batch at a data position (replica = dp coordinate x ep
    + ep coordinate); the ranks of a pipeline draw the same one (the synthetic global batch is seeded by the
    position and cut into dp x ep contiguous shares, or the same packed text batch), so no data is sent."""
    replicas = args.dp * args.ep
    if run.data is not None:
        return run.data.train_batch(position * replicas + replica)
    gen = torch.Generator().manual_seed((args.seed * 100003 + position) * 1009)
    x, y = synthetic_batch(run.config.vocab_size, args.micro_batch_size * args.num_mb * replicas, args.seq_len, gen)
    return x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]


def pipeline_batch(run: RankSetup, x: torch.Tensor, y: torch.Tensor) -> dict:
    """This rank's part of a batch: the inputs of the chains starting here, the labels of those ending here
    (each chain takes its own micro-batches)."""
    sched = run.schedule
    num_mb = sched.num_microbatches
    first = [c for c, ranks in enumerate(sched.placement) if ranks[0] == run.pp_rank]
    last = [c for c, ranks in enumerate(sched.placement) if ranks[-1] == run.pp_rank]
    mb_x, mb_y = x.tensor_split(num_mb), y.tensor_split(num_mb)
    inputs = (torch.cat([mb_x[m] for m in sched.microbatches_of(first[0])]),) if first else ()
    labels = (torch.cat([mb_y[m] for m in sched.microbatches_of(last[0])]),) if last else ()
    return {"inputs": inputs, "labels": labels}


def gathered_losses(mods: list, world: int, extra: Any = None) -> tuple[list, list]:
    """Every rank's logged (main, [mtp]) losses of this step, and every rank's ``extra`` (collective)."""
    logs = [entry for m in mods for entry in m.loss_log]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (logs, extra))
    return [e for got, _ in everyone for e in got], [x for _, x in everyone]


def validation_loss(args, run: RankSetup, pipeline: Any, rank: int, world: int) -> float | None:
    """Mean main loss over ``--val-batches`` held-out batches, forward-only through the pipeline
    (collective; None without --corpus). Evaluation forwards do not count expert loads."""
    if run.data is None or not args.val_batches:
        return None
    criterion, total = criterion_for(run.mods), 0.0
    recording, pipeline.record_timeline = pipeline.record_timeline, False
    for i in range(args.val_batches):
        for m in run.mods:
            m.loss_log.clear()
        batch = pipeline_batch(run, *run.data.val_batch(i * args.replicas + run.replica))
        with torch.no_grad():
            pipeline.step(*batch["inputs"], num_chunks=run.schedule.num_microbatches, criterion=criterion,
                          labels=batch["labels"])
        logs, _ = gathered_losses(run.mods, world)
        total += sum(e[0] for e in logs) / len(logs)
    pipeline.record_timeline = recording
    return total / args.val_batches


def train(args, run: RankSetup, stepper, rank: int, world: int, on_step=None, on_fault=None) -> dict:
    """The training loop; returns the history of the good steps (a rewind drops the steps it undid)."""
    mods = run.mods
    tokens_per_step = args.global_batch * args.seq_len
    start = stepper.step_index  # > 0 after resuming from a checkpoint
    history: dict = {"first_step": start, "loss": [], "mtp_loss": [], "balance": [], "tokens_per_s": []}

    def batch_fn(position: int) -> dict:
        return pipeline_batch(run, *step_batch(args, run, position, run.replica))

    while stepper.step_index < args.steps:
        stepper.pipeline.record_timeline = stepper.step_index == args.steps - 1
        for m in mods:
            m.loss_log.clear()
        t0 = time.perf_counter()
        result = stepper.step(batch_fn)
        elapsed = time.perf_counter() - t0
        if not result.ok:  # every rank is back at the snapshot: forget the undone steps and the bad step's
            for moe in moe_layers(torch.nn.ModuleList(mods)):  # expert loads (not part of the state dict)
                moe.gate.load.zero_()
            for key in ("loss", "mtp_loss", "balance", "tokens_per_s"):
                del history[key][max(0, stepper.step_index - start):]
            if on_fault is not None:
                on_fault(result.fault, stepper, history)
            continue
        all_logs, balances = gathered_losses(mods, world, run.last_balance)
        main = sum(e[0] for e in all_logs) / len(all_logs)
        mtp = sum(sum(e[1]) / len(e[1]) for e in all_logs) / len(all_logs) if all_logs[0][1] else 0.0
        history["loss"].append(main)
        history["mtp_loss"].append(mtp)
        history["balance"].append(sum(balances) / world)
        history["tokens_per_s"].append(tokens_per_step / elapsed)
        if on_step is not None:
            on_step(result.step, history, stepper)
    stepper.close()
    history["timeline"] = stepper.pipeline.timeline if rank == 0 and stepper.pipeline.record_timeline else None
    return history


def grad_hook_for(run: RankSetup):
    """Runs once the step is known to be good, before ``optimizer.step()``: the balance-bias update from the
    expert loads summed over every rank routing through each layer (a buffer the optimizer does not touch,
    so doing it here keeps each snapshot consistent). The gradients need nothing: the pipeline's step
    reduced them (mirrored stages, the MTP embedding copy, data- and expert-parallel replicas)."""
    mods = torch.nn.ModuleList(run.mods)

    def hook() -> None:
        sync_expert_load(run.mods, run.dims)
        run.last_balance = max_violation(mods)
        update_expert_bias(mods)

    return hook


# ----- summary ----------------------------------------------------------------------------------------
def fault_record(event) -> dict:
    return {"step": event.step, "position": event.position, "kind": event.kind.name.lower(), "ranks": event.ranks,
            "cause": event.cause, "rewound_to": event.rewound_to, "skipped": event.skipped}


def launch_tuple(args: argparse.Namespace) -> dict:
    """The (pp, dp, ep, tp, schedule, microbatches, dp_mode, recompute) tuple this run launched."""
    return {"pp": args.pp, "dp": args.dp, "ep": args.ep, "tp": 1, "schedule": args.schedule,
            "microbatches": args.num_mb, "dp_mode": args.dp_mode, "recompute": args.recompute}


def activation_peaks(stepper, world: int) -> list[int | None]:
    """Every rank's peak of saved-activation bytes in the last step, as the runtime recorded it (collective)."""
    everyone: list = [None] * world
    dist.all_gather_object(everyone, stepper.pipeline.peak_activation_bytes)
    return everyone


def optimizer_state_bytes(run: RankSetup, world: int) -> list[tuple[int, int]]:
    """Every rank's (optimizer-state bytes, parameters) (collective). ZeRO-1 shards each weight's state over
    all the ranks that reduce its gradient (its copies x replicas), so the ranks' bytes add up to one
    model's state, where all-reduce keeps a full copy next to every parameter copy."""
    everyone: list = [None] * world
    own = sum(p.numel() for m in run.mods for p in m.parameters())
    dist.all_gather_object(everyone, (int(run.opt.state_bytes()), own))
    return everyone


def fp8_weight_copies(run: RankSetup, world: int) -> list[tuple[int, int]]:
    """Every rank's (pipeline rank, bytes of its FP8 linears' cached E4M3 weights and scales) (collective): the
    runtime's recorder counts those copies (autograd saves them), the planner counts them as weights."""
    from mt_dualpipe.fp8.linear import FP8Linear

    own = sum(q.data.numel() * q.data.element_size() + q.scale.numel() * q.scale.element_size()
              for m in run.mods for lin in m.modules() if isinstance(lin, FP8Linear)
              for q in (lin.quantized_weight(),))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (run.pp_rank, int(own)))
    return everyone


def planned_activation_peaks(args: argparse.Namespace, run: RankSetup) -> list[float]:
    """The planner's peak of saved-activation bytes per pipeline rank for this run: its stage split, schedule,
    precision, recompute policy and memory savers (``planner.activations``, ``estimate.activation_peak_bytes``),
    with the core attention the demo runs (``--core-attention``: eager, or flash as the planner's "fused")."""
    from mt_dualpipe.planner import ModelSpec
    from mt_dualpipe.planner.activations import FP8_LIN, memory_savers
    from mt_dualpipe.planner.estimate import planned_rank_peaks

    config, sched = run.config, run.schedule
    elem = next(p for m in run.mods for p in m.parameters()).element_size()
    with memory_savers(config.memory_savers):
        items = ModelSpec.from_deepseek_config(config).items(
            args.seq_len, act_unit=FP8_LIN if args.fp8 else float(elem), recompute=args.recompute, elem=float(elem),
            micro_batch_size=args.micro_batch_size,
            attention="fused" if config.core_attention == "flash" else "eager")
    tokens = args.seq_len * args.micro_batch_size
    return planned_rank_peaks(sched, items, list(run.split.counts), tokens, config.dim * elem * tokens)[:args.pp]


def summarize(args, run: RankSetup, stepper, history: dict) -> dict:
    from mt_dualpipe.visualize.measured import compare_bubble

    tl, sched = history["timeline"], run.schedule
    bubble = compare_bubble(tl, sched).to_dict() if tl is not None else {"measured": None, "simulated": None}
    if tl is not None and args.timeline:
        Path(args.timeline).write_text(tl.to_json(indent=1))
    steady = history["tokens_per_s"][1:] or history["tokens_per_s"]
    return {
        "schedule": args.schedule, "ranks": args.pp, "pp": args.pp, "dp": args.dp, "ep": args.ep, "tp": 1,
        "dp_mode": args.dp_mode, "steps": args.steps, "microbatches": args.num_mb,
        "launch": launch_tuple(args),  # what `mt-dualpipe plan --json` calls "launch"
        "micro_batch_size": args.micro_batch_size, "global_batch": args.global_batch, "seq_len": args.seq_len,
        "preset": args.preset,
        "optimizer_state_bytes_per_rank": [b for b, _ in history["optimizer_state_bytes"]],
        "parameters_per_rank": [n for _, n in history["optimizer_state_bytes"]],
        "layout": layout_string(run.config, sched.num_stages(0), list(run.split.counts)),
        "modelled_cost_per_stage": list(run.split.stages), "modelled_cost_per_rank": list(run.split.ranks),
        "fp8": args.fp8, "fp8_backend": run.fp8_backend, "fp8_gemm": run.fp8_gemm,
        "data": "synthetic" if run.data is None else {
            "corpus": args.corpus, "files": len(run.data.files), "tokenizer": run.data.tokenizer.name,
            "vocab_size": run.config.vocab_size, "train_sequences": run.data.num_train,
            "held_out_sequences": run.data.num_val, "val_every": args.val_every},
        "val_loss": history.get("val_loss"),
        "first_step": history["first_step"],
        "loss": history["loss"], "mtp_loss": history["mtp_loss"], "expert_load_max_violation": history["balance"],
        "tokens_per_s": sum(steady) / len(steady) if steady else None,
        "recompute": args.recompute, "compile": args.compile,
        "activation_peak_bytes_per_rank": history["activation_peak_bytes"],
        "memory_savers": sorted(run.config.memory_savers), "core_attention": run.config.core_attention,
        "planned_activation_peak_bytes_per_pp_rank": planned_activation_peaks(args, run),
        "pp_rank_per_rank": [r for r, _ in history["rank_stages"]],
        "fp8_weight_copy_bytes_per_rank": [b for _, b in history["rank_stages"]],
        "step_time_s": args.global_batch * args.seq_len * len(steady) / sum(steady) if steady else None,
        "bubble_rate": bubble,
        "rewind": not args.no_rewind, "snapshot_every": None if args.no_rewind else args.snapshot_every,
        "from_pretrained": args.from_pretrained, "save_pretrained": args.save_pretrained,
        "checkpoint_dir": args.checkpoint_dir, "checkpoint_mode": stepper.checkpoint_mode,
        "checkpoints_written": stepper.counters["checkpoints"], "resumed_from": stepper.resumed_from,
        "rewinds": stepper.counters["rewinds"], "skipped_batches": sorted(stepper.skipped),
        "rewind_overhead_s": dict(stepper.seconds),  # checks, agreement, snapshots, checkpoints, rewinds
        "faults": [fault_record(e) for e in stepper.events],
        "config": run.config.to_dict(),
    }


def report(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    mesh = "".join(f" x {k} {summary[k]}" for k in ("dp", "ep") if summary[k] > 1)
    mode = f" ({summary['dp_mode']})" if mesh and summary["dp_mode"] != "allreduce" else ""
    t = Table(title=f"DeepSeek-V3 ({summary['preset']}, {summary['config']['n_layers']} layers) · "
                    f"{summary['schedule']} on {summary['pp']}{mesh} CPU ranks{mode}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    first = f"step {summary['first_step']}" if summary["first_step"] else "first"
    if summary["loss"]:
        t.add_row(f"loss ({first} → last step)", f"{summary['loss'][0]:.3f} → {summary['loss'][-1]:.3f}")
        t.add_row(f"MTP loss ({first} → last step)", f"{summary['mtp_loss'][0]:.3f} → {summary['mtp_loss'][-1]:.3f}")
        t.add_row("expert load max violation (last)", f"{summary['expert_load_max_violation'][-1]:.3f}")
        t.add_row("tokens/s", f"{summary['tokens_per_s']:.0f}")
        t.add_row(f"step time (recompute {summary['recompute']})", f"{summary['step_time_s']:.3f} s")
        peaks = [p for p in summary["activation_peak_bytes_per_rank"] if p is not None]
        if peaks:
            t.add_row(f"saved activations peak per rank (recompute {summary['recompute']})",
                      " ".join(f"{p / 2**20:.2f}" for p in peaks) + " MiB")
        savers = summary["memory_savers"]
        savers = "all" if len(savers) == len(MEMORY_SAVERS) else ",".join(savers) or "none"
        planned = summary["planned_activation_peak_bytes_per_pp_rank"]
        copies = summary["fp8_weight_copy_bytes_per_rank"]  # recorded with the activations, weights to the planner
        per_rank = [planned[r] + (c if summary["fp8"] else 0) for r, c in zip(summary["pp_rank_per_rank"], copies)]
        core = ", flash core" if summary.get("core_attention") == "flash" else ""
        t.add_row(f"planner's peak per rank (savers: {savers}{core}"
                  f"{', + FP8 weight copies' if summary['fp8'] else ''})",
                  " ".join(f"{p / 2**20:.2f}" for p in per_rank) + " MiB")
    val = summary["val_loss"]
    if val and val[0] is not None:
        t.add_row("validation loss (before → after)", f"{val[0]:.3f} → {val[1]:.3f}")
    bub = summary["bubble_rate"]
    if bub["measured"] is not None:
        t.add_row("bubble rate measured / simulated", f"{100 * bub['measured']:.1f} % / {100 * bub['simulated']:.1f} %")
    if summary["rewind"]:
        steps = ", ".join(str(f["step"]) for f in summary["faults"] if f["rewound_to"] >= 0)
        skipped = ", ".join(map(str, summary["skipped_batches"]))
        rewinds = f"{summary['rewinds']}" + (f" (step {steps})" if steps else "")
        skips = f"{len(summary['skipped_batches'])}" + (f" (batch {skipped})" if skipped else "")
        t.add_row("rewinds / skipped batches", f"{rewinds} / {skips}")
    if summary["resumed_from"] is not None:
        t.add_row("resumed from checkpoint", f"step {summary['resumed_from']}")
    if summary["checkpoint_dir"]:
        t.add_row("checkpoints written", f"{summary['checkpoints_written']} ({summary['checkpoint_mode']})")
    if summary["fp8_gemm"]:
        t.add_row("fp8 GEMM", summary["fp8_gemm"])
    Console().print(t)
    if bub["measured"] is not None:
        print(f"bubble: {bub['explanation']}")


# ----- process entry ----------------------------------------------------------------------------------
def progress_callbacks(args: argparse.Namespace, rank: int):
    """(progress bar or None, on_step, on_fault) for this rank: a rich bar or log lines on rank 0, nothing elsewhere."""
    if rank != 0:
        return None, None, None

    def stats(h: dict, stepper) -> str:
        rewinds = stepper.counters["rewinds"]
        return (f"loss {h['loss'][-1]:.3f} mtp {h['mtp_loss'][-1]:.3f} maxvio {h['balance'][-1]:.2f} "
                f"{h['tokens_per_s'][-1]:.0f} tok/s" + (f" · rewinds {rewinds}" if rewinds else ""))

    def fault_line(event) -> str:
        what = f"batch {event.position} skipped" if event.skipped else "batch retried"
        return f"step {event.step}: {event.cause} → rewound to step {event.rewound_to}, {what}"

    if args.no_progress:
        def on_step(step, h, stepper):
            print(f"step {step + 1}/{args.steps} {stats(h, stepper)}", flush=True)

        def on_fault(event, stepper, h):
            print(fault_line(event), flush=True)

        return None, on_step, on_fault

    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                        TextColumn("{task.fields[stats]}"), TimeElapsedColumn())
    where = f"{args.pp} ranks" + mesh_words(args)
    task = progress.add_task(f"{args.schedule} · {where}", total=args.steps, stats="")

    def on_step(step, h, stepper):
        progress.update(task, completed=stepper.step_index, stats=stats(h, stepper))

    def on_fault(event, stepper, h):
        progress.console.print(f"[yellow]{escape(fault_line(event))}")
        progress.update(task, completed=stepper.step_index)

    return progress, on_step, on_fault


def run_rank(rank: int, world: int, args: argparse.Namespace, init: str) -> None:
    torch.set_num_threads(1)
    # Rank 0 reports each rewind itself (one line, the agreed cause); keep every rank's warning off the screen.
    logging.getLogger("mt_dualpipe.resilience").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        run = setup(args, rank, world)
        args.num_mb = run.schedule.num_microbatches
        line = start_line(args, run, world)
        stepper = make_stepper(args, run, rank, world, grad_hook_for(run))
        if rank == 0:
            print(line)
            print(split_line(run.config, run.split))
            if run.fp8_backend:
                print(run.fp8_backend)
            if stepper.resumed_from is not None:
                print(f"resumed from the checkpoint of step {stepper.resumed_from} in {args.checkpoint_dir}")
            sys.stdout.flush()
        progress, on_step, on_fault = progress_callbacks(args, rank)
        if progress is not None:
            progress.update(progress.task_ids[0], completed=stepper.step_index)
            progress.start()
        before = validation_loss(args, run, stepper.pipeline, rank, world)
        try:
            history = train(args, run, stepper, rank, world, on_step, on_fault)
        finally:
            if progress is not None:
                progress.stop()
        history["val_loss"] = [before, validation_loss(args, run, stepper.pipeline, rank, world)]
        history["optimizer_state_bytes"] = optimizer_state_bytes(run, world)
        history["activation_peak_bytes"] = activation_peaks(stepper, world)
        history["rank_stages"] = fp8_weight_copies(run, world)
        if args.save_pretrained:  # collective: each rank writes its stages' tensors, rank 0 the index
            from mt_dualpipe.models.hf_checkpoint import save_pipeline_checkpoint

            save_pipeline_checkpoint(run.mods, args.save_pretrained, group=dist.group.WORLD)
        if rank == 0:
            summary = summarize(args, run, stepper, history)
            report(summary)
            if args.save_pretrained:
                print(f"checkpoint written to {args.save_pretrained} (Hugging Face layout)")
            if args.summary:
                Path(args.summary).write_text(json.dumps(summary, indent=1))
                print(f"summary written to {args.summary}")
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = depth_problem(args)
    if problem:
        raise SystemExit(f"error: {problem}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: we are one of the ranks
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")  # parse_args set --pp
        return 0
    init = local_init_method()
    world = args.pp * args.dp * args.ep
    spawn_local_ranks(run_rank, world, (world, args, init))  # forked from a server that imported torch once
    return 0


if __name__ == "__main__":
    sys.exit(main())
